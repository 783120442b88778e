"""Hypothesis strategies for meshes, layouts and shapes, and the reference block map.

`expected_block` says which block of the global tensor a rank must hold, read
straight from the notation's definition (mixed radix over a dim's axes, major
first; a fused dim's parts each split so, the rank's pieces in part order;
partial sums kept on the first rank of each group), independently of the
placement code under test.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace

import torch
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor

import hp
from hp.layouts.types import Dim, Layout

AXIS_NAMES = ("dp", "tp", "cp", "x", "y")
DIM_NAMES = ("b", "s", "h", "d", "e", "heads")


@st.composite
def mesh_axes(draw, max_ranks: int = 8, max_axes: int = 3):
    """1-3 named axes of sizes 1-4 whose product is at most max_ranks."""
    n = draw(st.integers(1, max_axes))
    names = draw(st.permutations(AXIS_NAMES))[:n]
    sizes, total = [], 1
    for _ in names:
        size = draw(st.integers(1, max(1, min(4, max_ranks // total))))
        sizes.append(size)
        total *= size
    return list(zip(names, sizes))


@st.composite
def placed_layout(draw, axes, rank=None, allow_partial=True, shape=None, fused=False):
    """A layout of a tensor on mesh `axes`, with a shape that its splits divide.

    With `fused`, dims split over at most one axis may be fused dims of 1-3 equal parts.
    """
    sizes = dict(axes)
    ndim = rank if rank is not None else (len(shape) if shape is not None else draw(st.integers(1, 4)))
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    partial = []
    for name in draw(st.permutations([a for a, _ in axes])):
        choice = draw(st.integers(-2 if allow_partial else -1, ndim - 1))
        if choice >= 0:
            per_dim[choice].append(name)
        elif choice == -2:
            partial.append(name)
    names = draw(st.permutations(DIM_NAMES))
    dims = []
    for d in range(ndim):
        kind = draw(st.integers(0, 5))
        if fused and kind < 2 and len(per_dim[d]) <= 1:
            parts = tuple(f"{names[d]}{k}" for k in range(draw(st.integers(1, 3))))
            dims.append(Dim(parts, tuple(per_dim[d]), fused=True))
        elif kind == 0:
            dims.append(Dim((names[d], f"f{d}"), tuple(per_dim[d]), composite=True))
        else:
            dims.append(Dim((names[d],), tuple(per_dim[d])))
    if any(d.fused and d.axes and len(d.factors) > 1 for d in dims):
        # DTensor cannot gather a split fused dim beside a dim split against mesh order: hp refuses
        order = [a for a, _ in axes]
        dims = [replace(d, axes=tuple(sorted(d.axes, key=order.index))) for d in dims]
    layout = Layout(tuple(dims), tuple(partial))
    if shape is None:
        shape = tuple(
            len(dim.factors) ** dim.fused * math.prod(sizes[a] for a in dim.axes) * draw(st.integers(1, 3))
            for dim in dims
        )
    return layout, shape


@st.composite
def any_layout(draw):
    """A syntactically valid layout, not tied to a mesh, for notation round trips."""
    pool = list(draw(st.permutations(DIM_NAMES + ("t", "u", "v", "w", "k", "m", "n"))))  # 4 dims of 3 names
    axes_pool = list(draw(st.permutations(AXIS_NAMES + ("ep", "fsdp", "tpx", "tpy", "pp", "sp"))))
    dims = []
    ellipsis_at = draw(st.integers(-1, 4))
    for d in range(draw(st.integers(0, 4))):
        if d == ellipsis_at:
            dims.append(Dim(("...",)))
            continue
        kind = draw(st.sampled_from(["name", "name", "size", "composite", "fused"]))
        if kind == "fused":
            split = tuple(axes_pool.pop() for _ in range(draw(st.integers(0, 2))))
            dims.append(draw(fused_dim(pool, split)))
            continue
        if kind == "size":
            factors, composite = (str(draw(st.integers(1, 64))),), False
        elif kind == "composite":
            k = draw(st.integers(1, 3))
            factors, composite = tuple(pool.pop() for _ in range(k)), True
        else:
            factors, composite = (pool.pop(),), False
        split = tuple(axes_pool.pop() for _ in range(draw(st.integers(0, 2))))
        dims.append(Dim(factors, split, composite))
    partial = tuple(axes_pool.pop() for _ in range(draw(st.integers(0, 2))))
    tier = draw(st.sampled_from(hp.layouts.types.TIERS))
    return Layout(tuple(dims), partial, tier)


@st.composite
def fused_dim(draw, pool: list[str], axes: tuple[str, ...] = ()):
    """A fused dim of 1-3 parts taken from `pool`: names, anonymous sizes, or sized names."""
    n = draw(st.integers(1, 3))
    anonymous = [draw(st.integers(0, 3)) == 0 for _ in range(n)]
    sized = any(anonymous) or draw(st.booleans())
    sizes = tuple(draw(st.integers(1, 96)) for _ in range(n)) if sized else ()
    parts = tuple(str(sizes[k]) if anonymous[k] else pool.pop() for k in range(n))
    return Dim(parts, axes, fused=True, sizes=sizes)


def rank_coords(mesh, rank: int) -> dict[str, int]:
    where = (mesh.mesh == rank).nonzero()[0].tolist()
    return dict(zip(mesh.mesh_dim_names, where))


def expected_block(t: torch.Tensor, layout: Layout, mesh, rank: int) -> torch.Tensor:
    """The block of `t` that `rank` holds under `layout`, from the notation's definition."""
    coord = rank_coords(mesh, rank)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    block = t
    for d, dim in enumerate(layout.dims):
        if not dim.axes:
            continue
        count, index = 1, 0
        for a in dim.axes:  # major first
            count *= sizes[a]
            index = index * sizes[a] + coord[a]
        if dim.fused:  # each part split on its own; the rank's pieces in part order
            parts = block.split(list(dim.part_sizes(block.shape[d])), d)
            block = torch.cat([part.chunk(count, d)[index] for part in parts], d)
            continue
        chunks = block.chunk(count, d) if block.shape[d] else ()
        if index < len(chunks):
            block = chunks[index]
        else:  # uneven: ranks past the last chunk hold an empty block
            block = block.narrow(d, 0, 0)
    if any(coord[a] != 0 for a in layout.partial):
        block = torch.zeros_like(block)
    return block


def local_blocks(x) -> dict[int, torch.Tensor]:
    """Per-rank local tensors of a DTensor under LocalTensorMode.

    A local tensor that no op has touched yet is a plain tensor, the same on every rank.
    """
    local = x.to_local()
    if isinstance(local, LocalTensor):
        return dict(local._local_tensors)
    return {r: local for r in range(x.device_mesh.size())}


@contextmanager
def simulate(axes):
    """A fake-backend mesh of `axes` ((name, size) pairs) under a LocalTensorMode of its ranks."""
    mesh = hp.mesh(list(axes), simulate=True)
    with hp.simulated(mesh):
        yield mesh

"""Layout <-> DTensor placements, for one concrete mesh and tensor shape.

DTensor describes a tensor by one placement per mesh dimension and applies
them in mesh order. A layout describes it per tensor dimension, with the
mesh axes of a dimension listed major first. The two agree directly when a
dimension's axes follow mesh order; when they do not (`h/x/y` on a mesh
ordered `(y, x)`), the mesh-earlier axis gets `_StridedShard` with a split
factor equal to the product of the major axes that DTensor applies after it.
The reverse map tries the few orders of each dimension's axes and keeps the
one whose placements match, so it never guesses.

A fused dim of n equal parts split over one axis (`[q k v]/tp`) is exactly
`_StridedShard(dim, split_factor=n)`: the dim is cut into n chunks first and
each chunk is sharded, so rank r holds piece r of every part. Unequal parts
have no placement (DTensor's chunks are equal); a fused dim split over two
axes, or split beside a dim split against mesh order, has placements that
DTensor distributes but cannot gather back correctly. All three are refused
when binding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.layouts.errors import LayoutError
from hp.layouts.types import Dim, Layout


def mesh_axes(mesh: DeviceMesh | Mapping[str, int]) -> dict[str, int]:
    """Mesh axis name -> size, in mesh order (a mapping of sizes stands for a mesh not built yet)."""
    if isinstance(mesh, Mapping):
        return dict(mesh)
    names = mesh.mesh_dim_names
    if not names:
        raise LayoutError("the mesh has no axis names; build it with hp.mesh(dp=..., tp=...)")
    return {name: mesh.size(i) for i, name in enumerate(names)}


def bind(
    layout: Layout, mesh: DeviceMesh, shape: Sequence[int], *, uneven: bool = False
) -> Layout:
    """Check `layout` against `mesh` and `shape`; return it with `...` expanded.

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, tp=2, simulate=True)
    >>> str(bind(hp.layout("... h/tp"), mesh, (4, 6, 8)))
    '4 6 h/tp'
    """
    sizes = mesh_axes(mesh)
    shape = tuple(int(s) for s in shape)
    concrete = layout.expand(shape)
    for i, dim in enumerate(concrete.dims):
        for j, axis in enumerate(dim.axes):
            _check_axis(concrete, sizes, axis, ("axis", i, j))
        if dim.size is not None and dim.size != shape[i]:
            raise concrete.error(
                f"dimension {i} is written as size {dim.size} but the tensor has {shape[i]}",
                at=("dim", i),
            )
        if dim.fused:
            _check_fused(concrete, i, dim, shape[i], sizes)
        else:
            _check_divisible(concrete, i, dim, shape[i], sizes, uneven)
    for axis in concrete.partial:
        _check_axis(concrete, sizes, axis, ("partial", axis))
    _check_fused_beside_strided(concrete, list(sizes))
    return concrete


def _check_axis(layout: Layout, sizes: dict[str, int], axis: str, at) -> None:
    if axis not in sizes:
        known = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise layout.error(f"unknown mesh axis '{axis}' (the mesh has {known})", at=at)


def _check_divisible(
    layout: Layout, i: int, dim: Dim, size: int, sizes: dict[str, int], uneven: bool
) -> None:
    count = math.prod(sizes[a] for a in dim.axes)
    if count <= 1 or size % count == 0:
        return
    order = list(sizes)
    in_mesh_order = [order.index(a) for a in dim.axes] == sorted(order.index(a) for a in dim.axes)
    if not uneven:
        raise layout.error(
            f"dimension {i} has size {size}, not divisible by its {count} shards "
            f"({' x '.join(f'{a}={sizes[a]}' for a in dim.axes)}); pass uneven=True to allow "
            "torch.chunk-style uneven shards",
            at=("dim", i),
        )
    if not in_mesh_order:
        raise layout.error(
            f"dimension {i} (size {size}) is split unevenly over axes against mesh order "
            f"({', '.join(order)}); DTensor supports uneven shards only in mesh order",
            at=("dim", i),
        )


def _check_fused(layout: Layout, i: int, dim: Dim, size: int, sizes: dict[str, int]) -> None:
    """Parts that add up to the dim, and a split that DTensor can express (module docstring)."""
    n = len(dim.factors)
    if dim.sizes and sum(dim.sizes) != size:
        raise layout.error(
            f"dimension {i} is written as parts of sizes {' + '.join(map(str, dim.sizes))} = "
            f"{sum(dim.sizes)} but the tensor has {size}",
            at=("dim", i),
        )
    if size % n:
        raise layout.error(
            f"dimension {i} has size {size}, not divisible into its {n} equal parts; "
            "write the part sizes, as in [q:64 k:16 v:16]",
            at=("dim", i),
        )
    if not dim.axes:
        return
    if len(dim.axes) > 1:
        raise layout.error(
            f"fused dimension {i} is split over {len(dim.axes)} mesh axes; DTensor cannot gather "
            "parts split over several axes back correctly: split it over one axis",
            at=("dim", i),
        )
    parts, count = dim.part_sizes(size), sizes[dim.axes[0]]
    if len(set(parts)) > 1:
        raise layout.error(
            f"fused dimension {i} has parts of unequal sizes ({' + '.join(map(str, parts))}) split "
            f"over '{dim.axes[0]}'; DTensor has no placement for that (its strided shards are equal "
            "chunks): lay the dimension out as equal parts, or keep it unsplit",
            at=("dim", i),
        )
    if parts[0] % count:
        raise layout.error(
            f"each part of fused dimension {i} has size {parts[0]}, not divisible by its {count} "
            f"shards ({dim.axes[0]}={count}); fused parts must split evenly",
            at=("dim", i),
        )


def _check_fused_beside_strided(layout: Layout, order: list[str]) -> None:
    """A split fused dim beside a dim split against mesh order: DTensor cannot gather both back."""
    fused = [i for i, d in enumerate(layout.dims) if d.fused and d.axes and len(d.factors) > 1]
    against = [
        i for i, d in enumerate(layout.dims)
        if [order.index(a) for a in d.axes] != sorted(order.index(a) for a in d.axes)
    ]
    if fused and against:
        raise layout.error(
            f"fused dimension {fused[0]} is split while dimension {against[0]} is split over axes "
            f"against mesh order ({', '.join(order)}); DTensor cannot gather the two strided shards "
            "back correctly: split that dimension in mesh order",
            at=("dim", fused[0]),
        )


def to_placements(layout: Layout, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """DTensor placements for a bound layout (see `bind`), one per mesh dimension.

    >>> import hp
    >>> to_placements(hp.layout("[q k v]/tp in"), hp.mesh(tp=2, simulate=True))
    (_StridedShard(dim=0, sf=3),)
    """
    sizes = mesh_axes(mesh)
    order = list(sizes)
    placements: list[Placement] = [Replicate()] * len(order)
    for d, dim in enumerate(layout.dims):
        parts = len(dim.factors) if dim.fused else 1
        for i, axis in enumerate(dim.axes):
            m = order.index(axis)
            # Major axes that DTensor applies later (higher mesh dim) must be
            # split off first: that is what _StridedShard's split factor says.
            # So must a fused dim's parts: each part is split on its own.
            factor = parts * math.prod(sizes[a] for a in dim.axes[:i] if order.index(a) > m)
            placements[m] = _StridedShard(d, split_factor=factor) if factor > 1 else Shard(d)
    for axis in layout.partial:
        placements[order.index(axis)] = Partial("sum")
    return tuple(placements)


def from_placements(
    placements: Sequence[Placement],
    mesh: DeviceMesh,
    shape: Sequence[int],
    names: Layout | None = None,
) -> Layout:
    """The layout that `placements` realise; dim names come from `names` if given.

    Dims without a name print as their size (anonymous dims), as in `8/dp 512`.

    >>> import hp
    >>> from torch.distributed.tensor.placement_types import _StridedShard
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> str(from_placements([_StridedShard(0, split_factor=3)], mesh, (96, 64), hp.layout("[q k v] in")))
    '[q k v]/tp in'
    """
    sizes = mesh_axes(mesh)
    order = list(sizes)
    per_dim: dict[int, list[str]] = {}
    partial: list[str] = []
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            per_dim.setdefault(p.dim, []).append(order[m])
        elif isinstance(p, Partial):
            if p.reduce_op != "sum":
                raise LayoutError(
                    f"placement {p} on mesh axis '{order[m]}' is a partial '{p.reduce_op}', "
                    "which the layout notation cannot express (only sums: '+axis')"
                )
            partial.append(order[m])
        elif not isinstance(p, Replicate):
            raise LayoutError(f"placement {p} on mesh axis '{order[m]}' has no layout notation")
    template = names.dims if names is not None and len(names.dims) == len(shape) else None
    dims = [
        _read_dim([template[d]] if template else [], d, size, per_dim.get(d, []), placements, mesh)
        for d, size in enumerate(shape)
    ]
    tier = names.tier if names is not None else "device"
    return Layout(tuple(dims), tuple(partial), tier)


def _read_dim(
    named: list[Dim], d: int, size: int, axes: list[str], placements: Sequence[Placement], mesh: DeviceMesh
) -> Dim:
    """The dim, its axes ordered major first, that reproduces `placements` on tensor dim d.

    Candidates in turn: the dim as hp named it, an anonymous dim, and an
    anonymous fused dim of equal parts (a strided shard on one axis that no
    order explains is a fused dim whose names were lost: `[16 16 16]/tp`).
    The order a candidate already has is tried first: size-1 axes make several
    orders equivalent, and the one the user wrote should win.
    """
    candidates = [*named, Dim((str(size),))]
    strided = [placements[mesh.mesh_dim_names.index(a)] for a in axes]
    if len(axes) == 1 and isinstance(strided[0], _StridedShard) and size % strided[0].split_factor == 0:
        n = int(strided[0].split_factor)
        candidates.append(Dim((str(size // n),) * n, fused=True))
    for bare in candidates:
        recorded = [bare.axes] if sorted(bare.axes) == sorted(axes) else []
        for candidate in recorded + list(itertools.permutations(axes)):
            trial = replace(bare, axes=tuple(candidate))
            got = to_placements(_single(trial, d), mesh)
            if all(got[mesh.mesh_dim_names.index(a)] == placements[mesh.mesh_dim_names.index(a)] for a in axes):
                return trial
    shown = ", ".join(str(p) for p in strided)
    raise LayoutError(f"placements ({shown}) of tensor dim {d} match no order of axes {axes}")


def _single(dim: Dim, d: int) -> Layout:
    """A layout with `dim` at position d and anonymous replicated dims elsewhere."""
    dims = tuple(dim if i == d else Dim(("1",)) for i in range(d + 1))
    return Layout(dims)

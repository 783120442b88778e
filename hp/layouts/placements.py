"""Layout <-> DTensor placements, for one concrete mesh and tensor shape.

DTensor describes a tensor by one placement per mesh dimension and applies
them in mesh order. A layout describes it per tensor dimension, with the
mesh axes of a dimension listed major first. The two agree directly when a
dimension's axes follow mesh order; when they do not (`h/x/y` on a mesh
ordered `(y, x)`), the mesh-earlier axis gets `_StridedShard` with a split
factor equal to the product of the major axes that DTensor applies after it.
The reverse map tries the few orders of each dimension's axes and keeps the
one whose placements match, so it never guesses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.layouts.errors import LayoutError
from hp.layouts.types import Dim, Layout


def mesh_axes(mesh: DeviceMesh) -> dict[str, int]:
    """Mesh axis name -> size, in mesh order."""
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
        _check_divisible(concrete, i, dim, shape[i], sizes, uneven)
    for axis in concrete.partial:
        _check_axis(concrete, sizes, axis, ("partial", axis))
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


def to_placements(layout: Layout, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """DTensor placements for a bound layout (see `bind`), one per mesh dimension."""
    sizes = mesh_axes(mesh)
    order = list(sizes)
    placements: list[Placement] = [Replicate()] * len(order)
    for d, dim in enumerate(layout.dims):
        for i, axis in enumerate(dim.axes):
            m = order.index(axis)
            # Major axes that DTensor applies later (higher mesh dim) must be
            # split off first: that is what _StridedShard's split factor says.
            factor = math.prod(sizes[a] for a in dim.axes[:i] if order.index(a) > m)
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
    dims = [template[d] if template else Dim((str(size),)) for d, size in enumerate(shape)]
    for d in range(len(shape)):
        dims[d] = _order_axes(dims[d], d, per_dim.get(d, []), placements, mesh)
    tier = names.tier if names is not None else "device"
    return Layout(tuple(dims), tuple(partial), tier)


def _order_axes(
    dim: Dim, d: int, axes: list[str], placements: Sequence[Placement], mesh: DeviceMesh
) -> Dim:
    """The order of `axes` (major first) that reproduces `placements` on dim d.

    The order `dim` already has is tried first: size-1 axes make several
    orders equivalent, and the one the user wrote should win.
    """
    recorded = [dim.axes] if sorted(dim.axes) == sorted(axes) else []
    for candidate in recorded + list(itertools.permutations(axes)):
        trial = Dim(dim.factors, tuple(candidate), dim.composite)
        got = to_placements(_single(trial, d), mesh)
        if all(got[mesh.mesh_dim_names.index(a)] == placements[mesh.mesh_dim_names.index(a)] for a in axes):
            return trial
    shown = ", ".join(str(placements[mesh.mesh_dim_names.index(a)]) for a in axes)
    raise LayoutError(f"placements ({shown}) of tensor dim {d} match no order of axes {axes}")


def _single(dim: Dim, d: int) -> Layout:
    """A layout with `dim` at position d and anonymous replicated dims elsewhere."""
    dims = tuple(dim if i == d else Dim(("1",)) for i in range(d + 1))
    return Layout(dims)

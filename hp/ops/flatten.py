"""Flattening leading dims when a later one of them is split: each rank's block flattens alone.

HF's causal-LM loss flattens the logits `b s/cp v` to `(b s) v` and the
labels `b s/cp` to `(b s)`. Each rank holds its sequence block of every
sample, so the flattened dim is split strided: `_StridedShard(0,
split_factor=b)` (the rows of each sample split over cp); with the batch
also split over dp, `(Shard(0), _StridedShard(0, split_factor=b/dp))`. torch
2.11 refuses such views ("Attempted to flatten multiple dimensions, with
dimension 1 being sharded"); the layout is exact, so hp flattens each block
and says so, on every release alike; viewing such rows back as `b s/cp` (a
per-token loss summed per sample) does the same in reverse. Flattening where
nothing splits strided (only the first dim of the group split) is left to
DTensor.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops.local import local_block, to_dtensor


def flatten_split_leading(input, *shape):
    """`input.view(*shape)` / `reshape` flattening its leading dims, one later one split; else NotImplemented.

    >>> import hp, torch
    >>> mesh = hp.mesh(cp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     x = hp.shard(torch.arange(24.0).reshape(2, 4, 3), "b s/cp v", mesh)
    ...     y = x.view(-1, 3)
    ...     print(tuple(y.shape), y.placements, bool((y.full_tensor() == torch.arange(24.0).reshape(8, 3)).all()))
    (8, 3) (_StridedShard(dim=0, sf=2),) True
    """
    if not isinstance(input, DTensor):
        return NotImplemented
    target = _target(input.shape, shape)
    if target is None:
        return NotImplemented
    group = input.ndim - len(target) + 1  # dims 0..group-1 become dim 0
    placements = flattened_placements(input.shape, input.placements, input.device_mesh.shape, group)
    if placements is None:
        return NotImplemented
    local = local_block(input)
    return to_dtensor(local.reshape(-1, *local.shape[group:]), input.device_mesh, placements, target)


def flattened_placements(shape, placements, mesh_shape, group: int, start: int = 0) -> list | None:
    """The `placements` of a tensor of `shape` once dims start..start+group-1 are one dim; None unless
    a later one of them is split.

    Mesh dims apply in order, each to the blocks the earlier ones left: a split
    of group dim d then cuts the flattened dim strided by the product of the
    sizes before d in those blocks (a plain Shard when that product is 1).
    Other orders (a strided split before another split of the dim) are left to
    DTensor: torch releases differ in how they redistribute those.

    >>> flattened_placements((2, 4, 3), (Shard(1),), (2,), 2)
    [_StridedShard(dim=0, sf=2)]
    """
    sizes, strided, later, out = list(shape[start:start + group]), False, False, []
    for m, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)) or p.dim < start:
            out.append(p)
        elif p.dim >= start + group:
            out.append(moved(p, p.dim - group + 1))
        elif not isinstance(p, Shard) or sizes[p.dim - start] % mesh_shape[m] or strided:
            return None
        else:
            factor = math.prod(sizes[:p.dim - start])
            strided, later = factor > 1, later or p.dim > start
            out.append(_StridedShard(start, split_factor=factor) if factor > 1 else Shard(start))
            sizes[p.dim - start] //= mesh_shape[m]
    return out if later else None


def moved(p: Shard, dim: int) -> Shard:
    """The split `p` (plain or strided) of another dim, `dim`.

    >>> moved(Shard(2), 1)
    Shard(dim=1)
    """
    return _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(dim)


def _wanted(args: tuple) -> tuple | None:
    """The sizes a `view(*args)` / `reshape(*args)` call asks for (given as one sequence or as
    arguments), when they are all plain ints; else None (symbolic sizes, no sizes)."""
    wanted = tuple(args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args)
    return wanted if wanted and all(isinstance(d, int) for d in wanted) else None


def _target(shape: torch.Size, args: tuple) -> tuple[int, ...] | None:
    """The view's shape when it flattens >= 2 leading dims of `shape` and keeps the rest, else None."""
    wanted = _wanted(args)
    if wanted is None:
        return None
    keep = len(wanted) - 1
    group = len(shape) - keep
    if group < 2 or tuple(wanted[1:]) != tuple(shape[group:]):
        return None
    flat = math.prod(shape[:group])
    return (flat, *shape[group:]) if wanted[0] in (-1, flat) else None


def unflatten_strided_leading(input, *shape):
    """`input.view(*shape)` / `reshape` undoing `flatten_split_leading`: `(a c)` split strided over `a` back
    to `a c/...`; else NotImplemented.

    >>> import hp, torch
    >>> mesh = hp.mesh(cp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     x = hp.shard(torch.arange(24.0).reshape(2, 4, 3), "b s/cp v", mesh)
    ...     y = x.view(-1, 3).sum(-1).view(2, 4)
    ...     print(hp.describe(y), bool((y.full_tensor() == torch.arange(24.0).reshape(2, 4, 3).sum(-1)).all()))
    f32[2, 4/cp] True
    """
    if not isinstance(input, DTensor) or input.ndim == 0:
        return NotImplemented
    wanted = _wanted(shape)
    if wanted is None or len(wanted) != input.ndim + 1 or wanted[2:] != tuple(input.shape[1:]):
        return NotImplemented
    rows, cols = wanted[0], wanted[1]
    if rows <= 0 or input.shape[0] % rows or cols not in (-1, input.shape[0] // rows):
        return NotImplemented
    unflattened = unflattened_placements(input.shape, input.placements, input.device_mesh.shape, rows)
    if unflattened is None:
        return NotImplemented
    placements, local_rows = unflattened
    local = local_block(input)
    target = (rows, input.shape[0] // rows, *input.shape[1:])
    return to_dtensor(local.reshape(local_rows, -1, *local.shape[1:]), input.device_mesh, placements, target)


def unflattened_placements(shape, placements, mesh_shape, rows: int) -> tuple[list, int] | None:
    """(the `placements` of a tensor of `shape` with dim 0 viewed as (rows, rest), the rows each rank
    holds): the inverse of `flattened_placements` for two dims; None unless a split of dim 0 becomes a
    split of the rest.

    A split of dim 0 strided by the rows each rank holds so far (or plain, once that is one
    row) cuts the rest; a plain split before it cuts the rows.
    """
    local_rows, cut_rest, out = rows, False, []
    for m, p in enumerate(placements):
        n = mesh_shape[m]
        factor = p.split_factor if isinstance(p, _StridedShard) else 1
        if not isinstance(p, (Shard, _StridedShard)):
            out.append(p)
        elif p.dim > 0:
            out.append(moved(p, p.dim + 1))
        elif factor == local_rows and (shape[0] // rows) % n == 0:
            out.append(Shard(1))
            cut_rest = True
        elif isinstance(p, Shard) and local_rows % n == 0 and not cut_rest:
            out.append(Shard(0))
            local_rows //= n
        else:
            return None
    return (out, local_rows) if cut_rest else None


def flatten_leading(input, start_dim: int = 0, end_dim: int = -1):
    """`input.flatten(0, end_dim)` by `flatten_split_leading`; NotImplemented for other dims.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     print(hp.shard(torch.ones(2, 4, 3), "b s/tp h", mesh).flatten(0, 1).placements)
    (_StridedShard(dim=0, sf=2),)
    """
    if not isinstance(input, DTensor) or start_dim != 0:
        return NotImplemented
    end = end_dim % input.ndim
    return flatten_split_leading(input, -1, *input.shape[end + 1:])


KERNELS = {  # view and reshape: flatten_split_leading, else unflatten_strided_leading (hp.region)
    torch.Tensor.flatten: flatten_leading,
    torch.flatten: flatten_leading,
}

"""Flattening leading dims when a later one of them is split: each rank's block flattens alone.

HF's causal-LM loss flattens the logits `b s/cp v` to `(b s) v` and the
labels `b s/cp` to `(b s)`. Each rank holds its sequence block of every
sample, so the flattened dim is split strided: `_StridedShard(0,
split_factor=b)` (the rows of each sample split over cp). Some torch releases
refuse that view ("Attempted to flatten multiple dimensions, with dimension 1
being sharded"); the layout is exact, so hp flattens each block and says so.
Flattening when the first dim of the group is split, or when more than one
is, is left to DTensor.
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
    split = [(m, p.dim) for m, p in enumerate(input.placements) if not p.is_replicate()]
    if len(split) != 1 or type(input.placements[split[0][0]]) is not Shard:
        return NotImplemented
    mesh_dim, dim = split[0]
    if not 0 < dim < group or input.shape[dim] % input.device_mesh.size(mesh_dim):
        return NotImplemented
    local = local_block(input)
    out = local.reshape(-1, *local.shape[group:])
    placements = list(input.placements)
    placements[mesh_dim] = _StridedShard(0, split_factor=math.prod(input.shape[:dim]))
    return to_dtensor(out, input.device_mesh, placements, target)


def _target(shape: torch.Size, args: tuple) -> tuple[int, ...] | None:
    """The view's shape when it flattens >= 2 leading dims of `shape` and keeps the rest, else None."""
    wanted = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not wanted or not all(isinstance(d, int) for d in wanted):
        return None
    keep = len(wanted) - 1
    group = len(shape) - keep
    if group < 2 or tuple(wanted[1:]) != tuple(shape[group:]):
        return None
    flat = math.prod(shape[:group])
    return (flat, *shape[group:]) if wanted[0] in (-1, flat) else None


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


KERNELS = {
    torch.Tensor.view: flatten_split_leading,
    torch.Tensor.reshape: flatten_split_leading,
    torch.Tensor.flatten: flatten_leading,
    torch.flatten: flatten_leading,
}

"""Differentiable redistribution to any layout, including into partial sums.

DTensor's `redistribute` refuses to create `Partial` placements ("internal
use only"), yet a layout may ask for one (`"b h +tp"`: the value is a pending
sum over tp). Turning a replicated value into a partial sum is exact without
communication: the first rank of each group keeps the value, the others hold
zeros. Its gradient is the incoming gradient on every rank, which this module
declares by marking the local gradient as a partial sum.

Moves into or out of a fused dim's strided shard (`[q k v]/tp`) go through
replicated on the strided axes: DTensor's planner gets some of those moves
wrong (wrong blocks, or an error, when they meet partial sums or other
strided shards), while gathering them first and splitting them last is right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from hp.layouts.specs import new_dtensor, spec_for


def reshard(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """`x` redistributed to `placements`; Partial targets are allowed."""
    placements = tuple(placements)
    into_partial = [
        m
        for m, p in enumerate(placements)
        if isinstance(p, Partial) and not isinstance(x.placements[m], Partial)
    ]
    staging = tuple(Replicate() if m in into_partial else p for m, p in enumerate(placements))
    if tuple(x.placements) != staging:
        x = _redistribute(x, staging)
    if into_partial:
        x = _replicate_to_partial(x, into_partial, placements)
    return x


def _only_sums(have: Sequence[Placement], wanted: tuple[Placement, ...]) -> bool:
    """The move only resolves pending sums into replicated values (a row-parallel output's
    all-reduce), in eager code: `_SumPending` makes it without DTensor's planner."""
    return not torch.compiler.is_compiling() and all(
        h == w or (isinstance(h, Partial) and h.reduce_op == "sum" and isinstance(w, Replicate))
        for h, w in zip(have, wanted)
    )


class _SumPending(torch.autograd.Function):
    """Pending sums all-reduced on their mesh axes; the gradient, replicated there, passes as it is.

    The most frequent move of a laid-out step (each row-parallel output meets the residual
    stream), made with hp's collectives, which skip one-rank axes, at a fraction of
    `redistribute`'s host cost.
    """

    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        mesh, local = x.device_mesh, x._local_tensor
        for m, (h, w) in enumerate(zip(x.placements, placements)):
            if h != w:
                local = _sum_over(local, mesh.get_group(m))
        ctx.placements = placements
        return new_dtensor(local, spec_for(mesh, placements, tuple(x.shape), x.stride(), local.dtype),
                           requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        return grad, None


def _sum_over(local: torch.Tensor, group) -> torch.Tensor:
    """`local` summed over `group`; nothing to move on a one-rank axis (a strategy that does not split there).

    `hp.ops.collectives.all_reduce` is the kernels' form, which also times its wait inside `hp.mpmd`;
    layouts sit below hp.ops and, like the `redistribute` this replaces, leave the wait untimed.
    """
    if group.size() == 1:
        return local
    return funcol.wait_tensor(funcol.all_reduce(local.contiguous(), "sum", group))


def cut(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """`x`, replicated on the mesh dims that `placements` shard, cut to each rank's block; its gradient
    comes back as a pending sum over those dims (each rank's block in place, zeros elsewhere).

    `redistribute` would gather the gradient instead. A value computed in full on every rank and
    then split by data parallel (a vision tower's output at the decoder's input) wants the pending
    sum: the parameters that computed it get pending gradients, resolved once with all the others
    (FSDP's reduce-scatter sums them, which a gathered, already whole gradient would double).
    """
    placements = tuple(placements)
    cuts = [m for m, (p, q) in enumerate(zip(x.placements, placements)) if p != q]
    if any(x.placements[m] != Replicate() or not isinstance(placements[m], Shard) for m in cuts):
        raise ValueError(f"cut only splits replicated dims: {x.placements} -> {placements}")
    return _Cut.apply(x, placements) if cuts else x


class _Cut(torch.autograd.Function):
    """Replicated -> sharded without communication, and back as a pending sum (each block in place)."""

    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.replicated = x.placements
        return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        mesh, shape = grad.device_mesh, tuple(grad.shape)
        _, offset = compute_local_shape_and_global_offset(shape, mesh, grad.placements)
        whole = _in_place(grad.to_local(), shape, offset)
        pending = [Partial() if p != q else p for p, q in zip(ctx.replicated, grad.placements)]
        return DTensor.from_local(whole, mesh, pending, run_check=False, shape=shape, stride=grad.stride()), None


@maybe_run_for_local_tensor  # rank-dependent: runs once per simulated rank
def _in_place(block: torch.Tensor, shape: tuple[int, ...], offset) -> torch.Tensor:
    """Zeros of `shape` holding `block` at `offset`."""
    whole = block.new_zeros(shape)
    whole[tuple(slice(o, o + n) for o, n in zip(offset, block.shape))] = block
    return whole


def _redistribute(x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """DTensor's redistribute, through whole strided axes when a fused dim is involved; pending sums
    resolved into replicated values by `_SumPending`."""
    if _only_sums(x.placements, placements):
        return _SumPending.apply(x, placements)
    if not (_has_fused(x.placements) or _has_fused(placements)):
        return x.redistribute(x.device_mesh, placements)
    for step in (_whole(x.placements), _whole(placements), placements):
        if tuple(x.placements) != step:
            x = x.redistribute(x.device_mesh, step)
    return x


def _has_fused(placements: Sequence[Placement]) -> bool:
    """A strided shard alone on its tensor dim is a fused dim's (a dim split against mesh
    order has a plain shard of the same dim beside its strided one)."""
    dims = [p.dim for p in placements if isinstance(p, (Shard, _StridedShard))]
    return any(isinstance(p, _StridedShard) and dims.count(p.dim) == 1 for p in placements)


def _whole(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, _StridedShard) else p for p in placements)


def _replicate_to_partial(x: DTensor, mesh_dims: list[int], placements) -> DTensor:
    mesh = x.device_mesh
    grad_placements = [Partial() if m in mesh_dims else p for m, p in enumerate(x.placements)]
    local = x.to_local(grad_placements=grad_placements)
    coords = mesh.get_coordinate()
    keep = _first_of_group(local, [coords[m] for m in mesh_dims])
    return DTensor.from_local(
        local * keep, mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
    )


@maybe_run_for_local_tensor  # rank-dependent: runs once per simulated rank
def _first_of_group(like: torch.Tensor, coords: list[int]) -> torch.Tensor:
    """1 on the rank whose coordinates on the given mesh dims are all 0, else 0."""
    return torch.ones((), dtype=like.dtype, device=like.device) * float(all(c == 0 for c in coords))

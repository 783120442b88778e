"""Collectives on local blocks, shared by hp's kernels: issued (in flight) or waited.

The `issue_*` forms return the collective's pending result, for a kernel that
computes while it flies (`hp.ops.overlap.wait` lands it and times the wait);
the plain forms wait at once. Every wait is timed inside `hp.mpmd`, so a
step's blocked time counts each collective hp's kernels run. Each is an
identity on a one-rank group: a mesh axis of size 1 (one device, or a
strategy that does not split there) lays tensors out without anything to
move, and a gloo or nccl call would still cost a round trip per op.

>>> import hp, torch
>>> mesh = hp.mesh(tp=1, simulate=True)
>>> all_reduce(torch.ones(2), "sum", mesh.get_group(0)).tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from hp.ops import overlap

# Newer torch names these *_single and deprecates the *_tensor forms, the only ones torch 2.11 has.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


def issue_all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """`t` reduced by `op` ("sum", "max", ...) over `group`, in flight."""
    return t if group.size() == 1 else overlap.issued(funcol.all_reduce(t.contiguous(), op, group))


def issue_all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The blocks of `group` concatenated along `dim`, in flight (torch waits at once for dim != 0:
    the blocks travel along dim 0 and are moved back after the wait)."""
    if group.size() == 1:
        return t
    return overlap.issued(_ALL_GATHER(t.movedim(dim, 0).contiguous(), 0, group))


def landed_gather(pending: torch.Tensor, dim: int) -> torch.Tensor:
    """An `issue_all_gather` along `dim` once it has landed (the wait timed)."""
    return overlap.wait(pending, ALL_GATHER).movedim(0, dim)


def issue_reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` summed over `group`, each rank keeping its block along `dim`, in flight."""
    return t if group.size() == 1 else overlap.issued(_REDUCE_SCATTER(t.contiguous(), "sum", dim, group))


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """`t` reduced by `op` ("sum", "max", ...) over `group`."""
    return t if group.size() == 1 else overlap.wait(issue_all_reduce(t, op, group), ALL_REDUCE)


def all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The blocks of `group` concatenated along `dim`."""
    if group.size() == 1:
        return t
    if torch.compiler.is_compiling():  # the graph orders its own waits (blocks along dim 0, as when issued)
        return funcol.wait_tensor(_ALL_GATHER(t.movedim(dim, 0).contiguous(), 0, group)).movedim(0, dim)
    return landed_gather(issue_all_gather(t, dim, group), dim)


def reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` summed over `group`, each rank keeping its block along `dim`."""
    return t if group.size() == 1 else overlap.wait(issue_reduce_scatter(t, dim, group), REDUCE_SCATTER)

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
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hp.ops import overlap
from hp.watch import counted_as

# Newer torch names these *_single and deprecates the *_tensor forms, the only ones torch 2.11 has.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"


def _through_work(group) -> bool:
    """Whether to issue on `group` through c10d's asynchronous work instead of a functional collective.

    On gloo, functional collectives corrupt the heap (a crash some steps later) when several
    are in flight while the rank computes on one that has landed, which is what pipelining
    does (torch 2.11 to 2.13); the same collectives through c10d's work objects do not. Other
    backends, simulated ranks and traced graphs keep the functional form.
    """
    return not torch.compiler.is_compiling() and dist.get_backend(group) == "gloo"


def issue_all_reduce(t: torch.Tensor, op: str, group):
    """`t` reduced by `op` ("sum", "max", ...) over `group`, in flight."""
    if group.size() == 1:
        return t
    if _through_work(group):
        out = t.clone(memory_format=torch.contiguous_format)
        reduce_op = getattr(dist.ReduceOp, op.upper())
        return overlap.issued(lambda: overlap.InFlight(out, dist.all_reduce(out, reduce_op, group=group,
                                                                            async_op=True)))
    return overlap.issued(lambda: funcol.all_reduce(t.contiguous(), op, group))


def issue_all_gather(t: torch.Tensor, dim: int, group):
    """The blocks of `group` concatenated along `dim`, in flight, the blocks along dim 0 (torch
    waits at once for dim != 0; `landed_gather` moves them back after the wait)."""
    if group.size() == 1:
        return t
    block = t.movedim(dim, 0).contiguous()
    if _through_work(group):
        out = block.new_empty((group.size() * block.shape[0], *block.shape[1:]))
        return overlap.issued(lambda: overlap.InFlight(out, dist.all_gather_into_tensor(out, block, group=group,
                                                                                        async_op=True)))
    return overlap.issued(lambda: _ALL_GATHER(block, 0, group))


def landed_gather(pending, dim: int) -> torch.Tensor:
    """An `issue_all_gather` along `dim` once it has landed (the wait timed)."""
    return overlap.wait(pending, ALL_GATHER).movedim(0, dim)


def issue_reduce_scatter(t: torch.Tensor, dim: int, group):
    """`t` summed over `group`, each rank keeping its block along `dim`, in flight.

    On gloo torch runs a reduce-scatter while it is issued, not in flight, so hp sends each rank
    its block of `t` with one all-to-all (the bytes a ring reduce-scatter sends) and sums the
    blocks that arrive, in rank order, once they have landed. `hp.comm.trace` counts it as the
    reduce-scatter it is.
    """
    if group.size() == 1:
        return t
    if _through_work(group):  # the blocks stacked along dim 0, as the functional form stacks them
        blocks = t.contiguous() if dim == 0 else torch.cat(torch.chunk(t, group.size(), dim))
        arrived = torch.empty_like(blocks)

        def issue():
            with counted_as(REDUCE_SCATTER):
                work = dist.all_to_all_single(arrived, blocks, group=group, async_op=True)
            return overlap.InFlight(arrived, work, finish=lambda rows: rows.unflatten(0, (group.size(), -1)).sum(0))

        return overlap.issued(issue)
    return overlap.issued(lambda: _REDUCE_SCATTER(t.contiguous(), "sum", dim, group))


def issue_all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """`rows` sent to the ranks of `group` by `in_splits` (rows to each, in rank order), in flight;
    lands as the rows received, `out_splits` from each."""
    rows = rows.contiguous()
    if _through_work(group):
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        return overlap.issued(lambda: overlap.InFlight(out, dist.all_to_all_single(
            out, rows, out_splits, in_splits, group=group, async_op=True)))
    return overlap.issued(lambda: funcol.all_to_all_single(rows, out_splits, in_splits, group))


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


def all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """`rows` sent to the ranks of `group` by `in_splits`; the rows received, `out_splits` from each."""
    return overlap.wait(issue_all_to_all(rows, out_splits, in_splits, group), ALL_TO_ALL)

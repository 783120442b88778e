"""Blocking collectives on local blocks, shared by hp's kernels.

Each waits for its result (the kernels use it at once) and is an identity on
a one-rank group: a mesh axis of size 1 (one device, or a strategy that does
not split there) lays tensors out without anything to move, and a gloo or
nccl call would still cost a round trip per op.

>>> import hp, torch
>>> mesh = hp.mesh(tp=1, simulate=True)
>>> all_reduce(torch.ones(2), "sum", mesh.get_group(0)).tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

# Newer torch names these *_single and deprecates the *_tensor forms, the only ones torch 2.11 has.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """`t` reduced by `op` ("sum", "max", ...) over `group`."""
    if group.size() == 1:
        return t
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), op, group))


def all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The blocks of `group` concatenated along `dim`."""
    if group.size() == 1:
        return t
    return funcol.wait_tensor(_ALL_GATHER(t.contiguous(), dim, group))


def reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` summed over `group`, each rank keeping its block along `dim`."""
    if group.size() == 1:
        return t
    return funcol.wait_tensor(_REDUCE_SCATTER(t.contiguous(), "sum", dim, group))

"""Value-selecting reductions (top-k, sort, max and min along a dim) whose gradient DTensor can build.

Their backward scatters the gradient into a fresh zero tensor at the
selected indices. In torch 2.11 that zero tensor is a plain tensor even when
the gradient is a DTensor, and the scatter refuses to mix them, so a MoE
router's `topk` over a laid-out tensor could not be differentiated. Here the
indices are selected without autograd and the values gathered at them:
gather's backward scatters into zeros like its input, a DTensor of the same
layout. The values and their gradient are the same as the op's own. Used
only on torch releases with that backward (`hp.backports`), and only where
each rank holds whole rows along the dim (a router's scores over experts).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hp import backports


def _selecting(op, dim_at: int, default_dim: int | None, keepdim_at: int | None = None):
    """A kernel for `op(input, ..., dim, ...)` -> (values, indices) that gathers the values.

    `dim_at` and `keepdim_at` are the positions of `dim` and `keepdim` among the arguments
    after the input (None: no keepdim, the dim is kept); `default_dim` is the dim when the
    call names none (None: a call without a dim is another op, such as a full max).
    """

    def kernel(input, *args, **kwargs):
        if not isinstance(input, DTensor) or not (input.requires_grad and torch.is_grad_enabled()):
            return NotImplemented
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else default_dim)
        if not isinstance(dim, int) or "out" in kwargs or not _whole_along(input, dim):
            return NotImplemented
        with torch.no_grad():
            selected = op(input, *args, **kwargs)
        indices = selected.indices
        kept = keepdim_at is None or kwargs.get("keepdim", args[keepdim_at] if len(args) > keepdim_at else False)
        if not kept:
            indices = indices.unsqueeze(dim)
        values = input.gather(dim, indices)
        return type(selected)((values if kept else values.squeeze(dim), selected.indices))

    return kernel


def _whole_along(input: DTensor, dim: int) -> bool:
    """Whether every rank holds whole rows along `dim` (nothing splits it, no pending sum): then the
    gather is local. Otherwise the op runs as it is (DTensor gathers along a split dim through a mask)."""
    return all(p.is_replicate() or (p.is_shard() and p.dim != dim % input.ndim) for p in input.placements)


def kernels(needed: bool = backports.SELECTION_BACKWARD_MIXES_TENSORS) -> dict:
    """The kernels, where this torch release needs them (`needed`; none where the op's own backward takes a DTensor).

    >>> torch.topk in kernels(needed=True), kernels(needed=False)
    (True, {})
    """
    if not needed:
        return {}
    ops = [(torch.topk, 1, -1, None), (torch.sort, 0, -1, None), (torch.max, 0, None, 1), (torch.min, 0, None, 1)]
    return {
        op: _selecting(op, *where)
        for function, *where in ops
        for op in (function, getattr(torch.Tensor, function.__name__))
    }

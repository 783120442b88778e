"""Value-selecting reductions (top-k, sort, max and min along a dim) whose gradient DTensor can build.

Their backward scatters the gradient into a fresh zero tensor at the
selected indices. In torch 2.11 that zero tensor is a plain tensor even when
the gradient is a DTensor, and the scatter refuses to mix them, so a MoE
router's `topk` over a laid-out tensor could not be differentiated. Where
each rank holds whole rows along the dim (a router's scores over experts),
each rank's block selects alone, values and gradient as the op's own, on
plain tensors. Used only on torch releases with that backward
(`BACKWARD_MIXES_TENSORS`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops.flatten import moved
from hp.ops.local import local_block, to_dtensor


BACKWARD_MIXES_TENSORS = torch.__version__ < (2, 13)
"""Whether top-k, sort, max and min along a dim scatter their gradient into a plain tensor
(torch 2.11; 2.13 builds it like the gradient). 2.12 is not checked and takes the same path,
which is exact anywhere."""


def _selecting(op, dim_at: int, default_dim: int | None, keepdim_at: int | None = None):
    """A kernel for `op(input, ..., dim, ...)` -> (values, indices) that selects on each rank's block.

    `dim_at` and `keepdim_at` are the positions of `dim` and `keepdim` among the arguments
    after the input (None: no keepdim, the dim is kept); `default_dim` is the dim when the
    call names none (None: a call without a dim is another op, such as a full max).
    """

    def kernel(input, *args, **kwargs):
        if not isinstance(input, DTensor):
            return NotImplemented
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else default_dim)
        if not isinstance(dim, int) or "out" in kwargs or not _whole_along(input, dim):
            return NotImplemented
        dim %= input.ndim
        selected = op(local_block(input), *args, **kwargs)  # rows are whole along dim: each block selects alone
        kept = keepdim_at is None or kwargs.get("keepdim", args[keepdim_at] if len(args) > keepdim_at else False)
        shape = list(input.shape)
        shape[dim] = selected.values.shape[dim] if kept else None
        shape = [n for n in shape if n is not None]
        placements = [p if kept or not isinstance(p, (Shard, _StridedShard)) or p.dim < dim else moved(p, p.dim - 1)
                      for p in input.placements]
        mesh = input.device_mesh
        return type(selected)((to_dtensor(selected.values, mesh, placements, shape),
                               to_dtensor(selected.indices, mesh, placements, shape)))

    return kernel


def _whole_along(input: DTensor, dim: int) -> bool:
    """Whether every rank holds whole rows along `dim` (nothing splits it, no pending sum): then each
    block selects alone. Otherwise the op runs as it is (DTensor's own rule)."""
    return all(p.is_replicate() or (isinstance(p, (Shard, _StridedShard)) and p.dim != dim % input.ndim)
               for p in input.placements)


def kernels(needed: bool = BACKWARD_MIXES_TENSORS) -> dict:
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

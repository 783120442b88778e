"""The way back from a kernel's local blocks to a DTensor, shared by hp's kernels.

Kernels (2D linear, vocab-parallel loss, Ulysses attention, ...) compute on
each rank's local block and hand the result back as a DTensor. The local
result is contiguous, so the global stride must say so too: DTensor trusts it
when a later `.contiguous()` or `.view()` decides whether to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Placement


def to_dtensor(
    local: torch.Tensor, mesh, placements: Sequence[Placement], shape, dim_order=None, stride=None
) -> DTensor:
    """Wrap a local block as a DTensor of global `shape` (differentiable).

    The block is contiguous, or, with `dim_order`, a permuted view of a contiguous buffer whose
    dims, outermost first, are `dim_order` (the global stride then says the same), or, with
    `stride`, a view whose global tensor has that stride (a slice keeps its source's).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> to_dtensor(torch.zeros(4, 3), mesh, [torch.distributed.tensor.Shard(1)], (4, 6)).stride()
    (6, 1)
    """
    if stride is None:
        order = list(dim_order) if dim_order is not None else list(range(len(shape)))
        dense = torch.empty([shape[d] for d in order], device="meta").stride()
        stride = [0] * len(shape)
        for position, d in enumerate(order):
            stride[d] = dense[position]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def local_block(param: DTensor, pending_axes: Sequence[int]) -> torch.Tensor:
    """`param`'s local block; its gradient is a pending sum over `pending_axes` (split tokens)."""
    grads = [Partial() if m in pending_axes else p for m, p in enumerate(param.placements)]
    return param.to_local(grad_placements=grads)

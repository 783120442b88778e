"""Attention and batched matmuls split only along their batch dims run on each rank's block.

Under tensor parallel, q, k and v arrive `b h/tp s d`: heads (and batches)
are independent problems, so each rank's attention, and each batched matmul
of an eager attention (`q @ k^T`, `weights @ v`), is the op itself on its
blocks. DTensor reaches the same blocks through a propagation per op, and
some torch releases refuse outright where a kernel flattens the batch dims
internally (SDPA's math path, matmul's batch folding: "Attempted to flatten
multiple dimensions, with dimension 1 being sharded"). These kernels run the
op on the blocks when every operand is split the same way along batch dims
only; anything else, and code `torch.compile` traces, is left to DTensor
(NotImplemented).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp.ops.local import cut_block, local_block, to_dtensor


def blockwise_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention` on each block of `b h s d` inputs split along b or h alike.

    A mask must be plain or replicated: each block gets the mask's matching block (its whole
    extent along a split dim where it has size 1 and broadcasts).
    Dropout is left to DTensor, whose random streams differ by block.

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with LocalTensorMode(2):
    ...     q = hp.shard(torch.randn(1, 4, 3, 8), "b h/tp s d", mesh)
    ...     print(hp.describe(blockwise_attention(q, q, q, is_causal=True)))
    f32[1, 4/tp, 3, 8]
    """
    if dropout_p or not _same_batch_split(query, key, value):
        return NotImplemented
    mask = None if attn_mask is None else _mask_block(attn_mask, query)
    if attn_mask is not None and mask is None:
        return NotImplemented
    out = F.scaled_dot_product_attention(
        local_block(query), local_block(key), local_block(value), attn_mask=mask, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )
    return _wrap(out, query, (*query.shape[:-1], value.shape[-1]))


def blockwise_matmul(input, other):
    """`torch.matmul` on each block where both operands are split alike along batch dims only."""
    if not _same_batch_split(input, other) or input.ndim < 3:
        return NotImplemented
    out = torch.matmul(local_block(input), local_block(other))
    return _wrap(out, input, (*input.shape[:-1], other.shape[-1]))


KERNELS = {
    torch.matmul: blockwise_matmul,
    torch.Tensor.matmul: blockwise_matmul,
    torch.Tensor.__matmul__: blockwise_matmul,
}


def _same_batch_split(*tensors) -> bool:
    """DTensors of one rank and mesh, laid out alike, split only along dims before the last two.

    Not while `torch.compile` traces: the graph holds the same local ops either way.
    """
    first = tensors[0]
    if torch.compiler.is_compiling() or not all(isinstance(t, DTensor) for t in tensors):
        return False
    placements, mesh, ndim = tuple(first.placements), first.device_mesh, first.ndim
    if any(t.device_mesh != mesh or t.ndim != ndim or tuple(t.placements) != placements for t in tensors):
        return False
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < ndim - 2) for p in placements)


def _mask_block(mask, query) -> torch.Tensor | None:
    """The block of a whole (plain or replicated) mask that meets `query`'s block, else None.

    Dims aligned from the right; a dim that splits `query` splits the mask alike unless the
    mask has size 1 there (it broadcasts), each rank taking its rows without communication.
    Declining a per-example mask (padding, packed sequences, any mask built under FakeTensor)
    would send SDPA to DTensor, whose only strategy with a mask keyword all-gathers q, k and v,
    and whose output stride then disagrees with the local one.
    """
    mesh = query.device_mesh
    if isinstance(mask, DTensor):
        if mask.device_mesh != mesh or not all(isinstance(p, Replicate) for p in mask.placements):
            return None
        mask = mask._local_tensor
    offset = query.ndim - mask.ndim
    cuts = []
    for p in query.placements:
        d = p.dim - offset if isinstance(p, Shard) else -1
        if d < 0 or mask.shape[d] == 1:
            cuts.append(Replicate())
        elif mask.shape[d] == query.shape[p.dim]:
            cuts.append(Shard(d))
        else:
            return None
    if all(isinstance(c, Replicate) for c in cuts):
        return mask
    return cut_block(mask, (Replicate(),) * mesh.ndim, tuple(cuts), mesh.get_coordinate(), mesh.shape)


def _wrap(out: torch.Tensor, like: DTensor, shape: tuple) -> DTensor:
    """The local result as a DTensor laid out as `like`, its global stride ordered as the block's."""
    order = sorted(range(out.ndim), key=lambda d: -out.stride(d)) if not out.is_contiguous() else None
    return to_dtensor(out, like.device_mesh, like.placements, shape, dim_order=order)

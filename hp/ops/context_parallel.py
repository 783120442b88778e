"""Context parallelism: attention on a sequence split over a mesh axis.

When q, k and v arrive laid out `b h s/cp d`, attention needs every key for
every query. Ulysses (DeepSpeed) swaps the split: an all-to-all turns
`heads, s/cp` into `heads/cp, s`, each rank runs ordinary attention (causal
masks included) on whole sequences for its share of heads, and a second
all-to-all swaps back. It needs the head counts divisible by the cp size and
moves 4 (p-1)/p of the local q, k, v, out per layer. The algorithm is chosen
with `hp.context_parallel("ulysses")` (the default); other algorithms
register here.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from hp.ops.local import to_dtensor

_ALGORITHM: contextvars.ContextVar[str] = contextvars.ContextVar("hp_cp_algorithm", default="ulysses")
ALGORITHMS = ("ulysses",)


@contextmanager
def context_parallel(algorithm: str = "ulysses"):
    """Choose how attention on a sequence-split layout runs inside the block.

    >>> import hp
    >>> with hp.context_parallel("ulysses"):
    ...     pass
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"context-parallel algorithm {algorithm!r} is not one of {ALGORITHMS}")
    token = _ALGORITHM.set(algorithm)
    try:
        yield
    finally:
        _ALGORITHM.reset(token)


def _swap(t: torch.Tensor, group, parts: int, heads_to_seq: bool) -> torch.Tensor:
    """(b, h, s/p, d) -> (b, h/p, s, d) when heads_to_seq, else the inverse, by one all-to-all."""
    b, h, s, d = t.shape
    if heads_to_seq:
        send = t.reshape(b, parts, h // parts, s, d).transpose(0, 1).contiguous()
    else:
        send = t.reshape(b, h, parts, s // parts, d).permute(2, 0, 1, 3, 4).contiguous()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))
    if heads_to_seq:  # leading index: the source rank's sequence chunk
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // parts, parts * s, d)
    return got.transpose(0, 1).reshape(b, parts * h, s // parts, d)


def sequence_parallel_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention` on `b h s/cp d` inputs; NotImplemented otherwise."""
    if not all(isinstance(t, DTensor) for t in (query, key, value)) or attn_mask is not None or dropout_p:
        return NotImplemented
    if query.ndim != 4 or not (query.placements == key.placements == value.placements):
        return NotImplemented
    mesh = query.device_mesh
    cp = [m for m, p in enumerate(query.placements) if p == Shard(2)]
    if len(cp) != 1 or query.shape[2] != key.shape[2]:
        return NotImplemented
    axis = cp[0]
    parts, group = mesh.size(axis), mesh.get_group(axis)
    q, k, v = (t.to_local() for t in (query, key, value))
    if q.shape[1] % parts or k.shape[1] % parts:
        return NotImplemented
    q, k, v = (_swap(t, group, parts, heads_to_seq=True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return to_dtensor(_swap(out, group, parts, heads_to_seq=False), mesh, query.placements, query.shape)

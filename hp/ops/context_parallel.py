"""Context parallelism: attention on a sequence split over a mesh axis.

When q, k and v arrive laid out `b h s/cp d`, attention needs every key for
every query. Ulysses (DeepSpeed) swaps the split: an all-to-all turns
`heads, s/cp` into `heads/cp, s`, each rank runs ordinary attention (causal
masks included) on whole sequences for its share of heads, and a second
all-to-all swaps back. It needs the head counts divisible by the cp size and
moves 4 (p-1)/p of the local q, k, v, out per layer. Ring attention
(`hp.ops.ring_attention`) keeps the heads and passes K/V blocks around the
ring instead: any head count, only the local q, k, v, output and log-sum-exp
saved for backward, (p-1) K/V blocks per layer forward. The algorithm is chosen with `hp.context_parallel("ulysses")` (the
default) or `hp.context_parallel("ring", order="head_tail")`, where the order
says how the caller laid the sequence out (see `head_tail_order`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hp.ops.local import to_dtensor
from hp.ops.ring_attention import ORDERS, RingAttention

# The innermost `context_parallel` choice last. A plain stack, not a ContextVar:
# `torch.compile` traces (and guards on) a module global's read, not ContextVar.get.
_ALGORITHM: list[tuple[str, str]] = [("ulysses", "contiguous")]

ORDERS_OF = {"ulysses": ("contiguous",), "ring": ORDERS}  # each algorithm, and the sequence orders it takes


@contextmanager
def context_parallel(algorithm: str = "ulysses", *, order: str = "contiguous"):
    """Choose how attention on a sequence-split layout runs inside the block.

    `order` is how the sequence was laid out over the cp ranks: "contiguous"
    (plain `s/cp`) or "head_tail" (tokens permuted by `head_tail_order` first,
    which balances causal work; ring attention only).

    >>> import hp
    >>> with hp.context_parallel("ring", order="head_tail"):
    ...     pass
    """
    if algorithm not in ORDERS_OF:
        raise ValueError(f"context-parallel algorithm {algorithm!r} is not one of {tuple(ORDERS_OF)}")
    if order not in ORDERS_OF[algorithm]:
        raise ValueError(f"sequence order {order!r} is not supported by {algorithm} attention "
                         f"(allowed: {ORDERS_OF[algorithm]})")
    _ALGORITHM.append((algorithm, order))
    try:
        yield
    finally:
        _ALGORITHM.pop()


def current_algorithm() -> tuple[str, str]:
    """(algorithm, order) of the innermost `context_parallel`, ("ulysses", "contiguous") outside any.

    >>> import hp
    >>> with hp.context_parallel("ring", order="head_tail"):
    ...     current_algorithm()
    ('ring', 'head_tail')
    """
    return _ALGORITHM[-1]


def swap_heads_and_sequence(t: torch.Tensor, group, parts: int, heads_to_seq: bool) -> torch.Tensor:
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
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    sinks=None, window=None,
):
    """`F.scaled_dot_product_attention` on `b h s/cp d` inputs; NotImplemented otherwise.

    In head-tail order a fallback would mask the permuted sequence as if it were
    in order (silently wrong), so there every unsupported call is an error.
    Ring attention also takes learned `sinks` (one logit per head, a DTensor laid
    out as the heads) and a sliding `window` (a query sees the keys less than
    `window` before it), for HF's eager attention with sinks
    (`hp.parallel.hf_attention`).
    """
    algorithm, order = current_algorithm()
    why = _unsupported(query, key, value, attn_mask, dropout_p, enable_gqa, algorithm)
    if not why and (sinks is not None or window is not None) and algorithm != "ring":
        why = "sinks and sliding windows are taken by ring attention only"
    if why:
        if order == "head_tail":
            raise RuntimeError(f"ring attention in head-tail order cannot run this call: {why}")
        return NotImplemented
    mesh = query.device_mesh
    axis = next(m for m, p in enumerate(query.placements) if p == Shard(2))
    parts, group = mesh.size(axis), mesh.get_group(axis)
    q, k, v = (t.to_local() for t in (query, key, value))
    shape = (*query.shape[:-1], value.shape[-1])  # values may be narrower than queries and keys (latent attention)
    if algorithm == "ring":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        args = (group, mesh.get_local_rank(axis), parts, order, is_causal, scale, window)
        local_sinks = local_heads(sinks, query) if sinks is not None else None
        out = RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), local_sinks, *args)
        return to_dtensor(out, mesh, query.placements, shape, dim_order=(0, 2, 1, 3))
    q, k, v = (swap_heads_and_sequence(t, group, parts, heads_to_seq=True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return to_dtensor(swap_heads_and_sequence(out, group, parts, heads_to_seq=False), mesh, query.placements, shape)


def local_heads(per_head: DTensor, query: DTensor) -> torch.Tensor:
    """The block of a per-head parameter (attention sinks) that goes with the rank's heads of `query`.

    Where it is replicated over an axis on which the ranks' queries differ (their batch, sequence
    or heads), each rank's gradient is a share of the sum: it pends there.
    """
    if not isinstance(per_head, DTensor):
        return per_head
    grads = [p if p.is_shard() or q == Replicate() else Partial() for p, q in zip(per_head.placements, query.placements)]
    return per_head.to_local(grad_placements=grads)


def _unsupported(query, key, value, attn_mask, dropout_p, enable_gqa, algorithm) -> str | None:
    """Why the context-parallel kernels cannot take this call (None when they can)."""
    if not all(isinstance(t, DTensor) for t in (query, key, value)):
        return "q, k and v must all be DTensors"
    if attn_mask is not None or dropout_p:
        return "attention masks and dropout are not supported"
    if query.ndim != 4 or not (query.placements == key.placements == value.placements):
        return f"q, k, v must be (b, h, s, d) with one layout, got {query.placements}, {key.placements}"
    if sum(p == Shard(2) for p in query.placements) != 1 or query.shape[2] != key.shape[2]:
        return "the sequence must be split over exactly one mesh axis, for queries and keys alike"
    if any(p.is_partial() for p in query.placements):
        return "q, k, v must not be pending sums"
    axis = next(m for m, p in enumerate(query.placements) if p == Shard(2))
    heads, kv_heads, parts = query.to_local().shape[1], key.to_local().shape[1], query.device_mesh.size(axis)
    if heads % kv_heads or (heads != kv_heads and not enable_gqa):
        return f"{heads} query heads and {kv_heads} key heads need enable_gqa"
    if algorithm == "ulysses" and (heads % parts or kv_heads % parts):
        return f"Ulysses needs the head counts ({heads}, {kv_heads}) divisible by the cp size {parts}"
    return None

"""Ring attention: causal attention on a sequence split over a mesh axis, K/V passed around the ring.

Each of the p ranks of the context-parallel axis keeps its queries and, in p
steps, sees every rank's keys and values: at each step it attends its queries
to the block it holds, merges the partial result into its running output by
log-sum-exp (out = sum_i exp(lse_i - lse) out_i), and passes the block to the
next rank while the next block is in flight. Only one foreign K/V block is
alive at a time, and backward saves only the local q, k, v, output and
log-sum-exp: activation memory per rank falls as 1/p. Backward runs the same
ring; the key/value gradients travel with their block and arrive home after
p hops.

Causal masks make contiguous chunks unfair (rank 0 attends to one block,
rank p-1 to p). With `order="head_tail"` the sequence is cut into 2p chunks
and rank r holds chunks r and 2p-1-r (`head_tail_order` gives the
permutation the caller applies to tokens, positions and labels): every rank
then does the same work at every step. Bytes per rank and layer: (p-1) K/V
blocks forward; (p-1) K/V blocks and p gradient blocks (fp32) backward.

Learned sinks (one logit per head in every softmax's denominator) join the
merged log-sum-exp once, at the end; a sliding window masks each block by
the global positions of its queries and keys, and skips blocks it hides.

Block kernels: CPU uses its flash kernel where values are as wide as queries
and no window cuts the block (forward returns the log-sum-exp, backward
accepts the merged output and log-sum-exp); other devices use an exact math
path in the same shape (materialising one block of scores).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor

aten = torch.ops.aten
ORDERS = ("contiguous", "head_tail")


def head_tail_order(seq_len: int, parts: int) -> torch.Tensor:
    """Token permutation after which a contiguous split over `parts` ranks gives rank r chunks r and 2p-1-r.

    >>> head_tail_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if seq_len % (2 * parts):
        raise ValueError(f"head-tail order needs the sequence length ({seq_len}) divisible by 2*{parts}")
    chunks = torch.arange(seq_len).view(2 * parts, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * parts - 1 - r]]) for r in range(parts)])


def _chunk_ids(coord: int, parts: int, order: str) -> list[int]:
    """Global chunk indices a rank holds, in its local order (chunks have equal size)."""
    return [coord] if order == "contiguous" else [coord, 2 * parts - 1 - coord]


def _visible(q_chunk: int, k_chunks: list[int], causal: bool) -> tuple[list[int], int | None]:
    """(key chunks fully visible to a query chunk, the one seen under the causal diagonal)."""
    if not causal:
        return list(range(len(k_chunks))), None
    full = [i for i, c in enumerate(k_chunks) if c < q_chunk]
    diagonal = next((i for i, c in enumerate(k_chunks) if c == q_chunk), None)
    return full, diagonal


# -- block kernels: attention of a query block to a key block, with its log-sum-exp -------------


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the device has a flash kernel taking and giving the log-sum-exp that hp uses (CPU's
    wants values as wide as queries, which latent attention's are not)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _block_forward(q, k, v, causal: bool, scale: float, allowed=None):
    """(out, lse) of a query block on a key block; `allowed` (bool, queries x keys) masks a sliding window."""
    if allowed is None and _fused(q, v):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse
    scores = _masked(q, k, causal, scale, allowed)
    lse = scores.logsumexp(-1)
    return (scores - _finite(lse)[..., None]).exp() @ v.float(), lse  # a row that sees no key: zeros, lse -inf


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, allowed=None):
    """(dq, dk, dv) of a block, given the merged output and log-sum-exp (so the block's share is exact)."""
    if allowed is None and _fused(q, v):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    prob = (_masked(q, k, causal, scale, allowed) - lse[..., None]).exp()
    dprob = dout.float() @ v.float().transpose(-2, -1)
    dscores = prob * (dprob - (dout.float() * out.float()).sum(-1, keepdim=True))
    return dscores @ k.float() * scale, dscores.transpose(-2, -1) @ q.float() * scale, prob.transpose(-2, -1) @ dout.float()


def _masked(q, k, causal: bool, scale: float, allowed) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if allowed is not None:
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return scores.masked_fill(_future(scores), float("-inf")) if causal else scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with -inf (nothing seen yet) as 0, so that exp(x - it) is 0 for x = -inf, not nan."""
    return lse.masked_fill(lse.isinf(), 0.0)


def _future(scores: torch.Tensor) -> torch.Tensor:
    return torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)


# -- one ring step on one rank ------------------------------------------------------------------


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _reduce_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == heads else grad.view(b, heads, h // heads, s, d).sum(2)


def _pairs(coord: int, step: int, parts: int, order: str, causal: bool, seq: int, window: int | None = None):
    """(query slice, key slices, causal, allowed) blocks this rank computes at `step` (keys of rank
    coord - step); `allowed` is None, or under a sliding window the mask of keys each query sees."""
    chunk = seq // len(_chunk_ids(coord, parts, order))
    k_ids = _chunk_ids((coord - step) % parts, parts, order)
    for a, q_id in enumerate(_chunk_ids(coord, parts, order)):
        rows = slice(a * chunk, (a + 1) * chunk)
        full, diagonal = _visible(q_id, k_ids, causal)
        blocks = ([(full, False)] if full else []) + ([([diagonal], True)] if diagonal is not None else [])
        for picked, causal_block in blocks:
            cols = [slice(i * chunk, (i + 1) * chunk) for i in picked]
            allowed = _window(q_id, [k_ids[i] for i in picked], chunk, causal_block, window)
            if allowed is None or allowed.any():  # a block wholly outside the window is skipped
                yield rows, cols, causal_block, None if allowed is None or allowed.all() else allowed


def _window(q_chunk: int, k_chunks: list[int], chunk: int, causal: bool, window: int | None):
    """Which keys each query of the block sees under a sliding window (HF's: q - k < window); None without."""
    if window is None:
        return None
    q = q_chunk * chunk + torch.arange(chunk)
    k = torch.cat([c * chunk + torch.arange(chunk) for c in k_chunks])
    allowed = (q[:, None] - k[None, :]) < window
    return allowed & (k[None, :] <= q[:, None]) if causal else allowed


def _keys(t: torch.Tensor, cols: list[slice]) -> torch.Tensor:
    return t[:, :, cols[0]] if len(cols) == 1 else torch.cat([t[:, :, c] for c in cols], dim=2)


@maybe_run_for_local_tensor  # which blocks a rank attends to depends on its ring position
def _attend(q, k, v, out, lse, coord: int, step: int, parts: int, order: str, causal: bool, scale: float,
            window: int | None = None):
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    out, lse = out.clone(), lse.clone()
    for rows, cols, causal_block, allowed in _pairs(coord, step, parts, order, causal, q.shape[2], window):
        o, l = _block_forward(q[:, :, rows], _keys(k, cols), _keys(v, cols), causal_block, scale, allowed)
        merged = torch.logaddexp(lse[:, :, rows], l)
        at = _finite(merged)
        out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - at).exp()[..., None] + o * (l - at).exp()[..., None]
        lse[:, :, rows] = merged
    return out, lse


@maybe_run_for_local_tensor
def _attend_backward(dout, q, k, v, out, lse, dq, dkv, coord: int, step: int, parts: int, order: str, causal: bool,
                     scale: float, window: int | None = None):
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    dq = dq.clone()
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    for rows, cols, causal_block, allowed in _pairs(coord, step, parts, order, causal, q.shape[2], window):
        gq, gk, gv = _block_backward(
            dout[:, :, rows], q[:, :, rows], _keys(k, cols), _keys(v, cols), out[:, :, rows], lse[:, :, rows],
            causal_block, scale, allowed,
        )
        dq[:, :, rows] += gq.float()
        at = 0
        for c in cols:  # the key slices were concatenated in this order
            width = c.stop - c.start
            dk[:, :, c] += gk[:, :, at : at + width].float()
            dv[:, :, c] += gv[:, :, at : at + width].float()
            at += width
    grads = torch.cat([_reduce_heads(dk, kv_heads), _reduce_heads(dv, kv_heads)], dim=-1)
    return dq, dkv + grads


# -- the ring -----------------------------------------------------------------------------------


@maybe_run_for_local_tensor
def _ring_splits(coord: int, parts: int, numel: int) -> tuple[int, ...]:
    """all_to_all split sizes (input then output) that send to the next rank and receive from the previous."""
    send = [numel if dst == (coord + 1) % parts else 0 for dst in range(parts)]
    recv = [numel if src == (coord - 1) % parts else 0 for src in range(parts)]
    return tuple(send + recv)


def _pass_on(t: torch.Tensor, coord, parts: int, group) -> tuple[torch.Tensor, torch.Size]:
    """Start sending `t` to the next rank of the ring; the previous rank's block is `_arrived(returned)`."""
    splits = list(_ring_splits(coord, parts, t.numel()))
    flat = t.contiguous().view(-1)
    got = funcol.all_to_all_single(flat, splits[parts:], splits[:parts], group)
    return got, t.shape


def _arrived(pending) -> torch.Tensor:
    got, shape = pending
    return funcol.wait_tensor(got).view(shape)


class RingAttention(torch.autograd.Function):
    """Causal (or full) attention of local q to the whole ring's k, v; inputs and output local (b, h, s/p, d).

    `sinks` (one logit per local head, or None) joins every softmax's denominator, as gpt-oss's
    learned sinks: the merged output is scaled by exp(lse - lse') with lse' = logaddexp(lse, sink),
    and backward, the ring's own step run with that output and lse' is exact for q, k and v.
    `window` (or None) is a sliding window: a query sees the keys less than `window` before it.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, coord, parts: int, order: str, causal: bool, scale: float,
                window: int | None = None):
        out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv, kd = torch.cat([k, v], dim=-1), k.shape[-1]  # one block on the ring; v may be narrower
        for step in range(parts):
            pending = _pass_on(kv, coord, parts, group) if step < parts - 1 else None
            out, lse = _attend(q, kv[..., :kd], kv[..., kd:], out, lse, coord, step, parts, order, causal, scale, window)
            if pending is not None:
                kv = _arrived(pending)
        if sinks is not None:
            with_sinks = torch.logaddexp(lse, sinks.float()[None, :, None])
            out, lse = out * (lse - with_sinks).exp()[..., None], with_sinks
        # (b, s, h, d) memory seen as (b, h, s, d): the usual transpose back to tokens copies
        # nothing, so the output projection saves this same storage instead of a copy
        # (not a copy_ into an empty buffer: torch 2.11's AOTAutograd saves the empty buffer for backward)
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring = (group, coord, parts, order, causal, scale, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, coord, parts, order, causal, scale, window = ctx.ring
        dout = dout.contiguous()
        dsinks = None
        if sinks is not None:  # a sink is a key whose value is zero: -sum p_sink (dout . out)
            share = (sinks.float()[None, :, None] - lse).exp() * (dout.float() * out.float()).sum(-1)
            dsinks = -share.sum((0, 2)).to(sinks.dtype)
        kv, kd = torch.cat([k, v], dim=-1), k.shape[-1]  # one block on the ring; v may be narrower
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(parts):
            pending = _pass_on(kv, coord, parts, group) if step < parts - 1 else None
            dq, dkv = _attend_backward(
                dout, q, kv[..., :kd], kv[..., kd:], out, lse, dq, dkv, coord, step, parts, order, causal, scale, window
            )
            dkv = _arrived(_pass_on(dkv, coord, parts, group))  # gradients follow their block home
            if pending is not None:
                kv = _arrived(pending)
        dk, dv = dkv[..., :kd], dkv[..., kd:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, *([None] * 7)

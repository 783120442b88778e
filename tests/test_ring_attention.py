"""Ring attention against F.scaled_dot_product_attention, on simulated cp meshes.

Shapes, head counts (GQA), value widths (latent attention's values are
narrower than its queries and keys), cp sizes, sequence orders and masks are drawn;
output and q/k/v gradients must match the unsharded attention, and the K/V
blocks must pass the ring exactly cp-1 times forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import hp
from hp.ops import ring_attention
from hp.ops.ring_attention import head_tail_order


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@given(
    cp=st.sampled_from([2, 4]),
    order=st.sampled_from(["contiguous", "head_tail"]),
    chunk=st.integers(1, 4),
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    fused=st.booleans(),
    value_width=st.sampled_from([8, 4]),
)
def test_ring_attention_matches_sdpa(cp, order, chunk, batch, kv_heads, group, causal, fused, value_width):
    seq = chunk * cp * (2 if order == "head_tail" else 1)
    heads, gqa = kv_heads * group, group > 1
    torch.manual_seed(seq + heads)
    q, k, v = (torch.randn(batch, h, seq, d, requires_grad=True)
               for h, d in ((heads, 8), (kv_heads, 8), (kv_heads, value_width)))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    grad = torch.randn_like(want)
    want.backward(grad)
    perm = head_tail_order(seq, cp) if order == "head_tail" else torch.arange(seq)
    mesh = hp.mesh(cp=cp, simulate=True)
    with block_kernels(fused), hp.simulated(mesh), hp.context_parallel("ring", order=order), hp.region():
        qs, ks, vs, gs = (hp.shard(t.detach()[:, :, perm], "b h s/cp d", mesh) for t in (q, k, v, grad))
        for t in (qs, ks, vs):
            t.requires_grad_(True)
        with hp.comm.trace() as trace:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
            out.backward(gs)
        back = torch.argsort(perm)
        got = [t.full_tensor()[:, :, back] for t in (out, qs.grad, ks.grad, vs.grad)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        assert rel_err(g, w) < 1e-5, name
    kv_block = batch * kv_heads * (seq // cp) * (8 + value_width) * 4
    forward = trace.select(phase="forward")
    assert [(r.kind, r.bytes) for r in forward] == [("send_recv", kv_block)] * (cp - 1)
    # backward: K/V blocks cp-1 times, their fp32 gradients cp times (home again)
    assert [r.kind for r in trace.select(phase="backward")] == ["send_recv"] * (2 * cp - 1)


@contextmanager
def block_kernels(fused: bool):
    """Use the CPU flash block kernel, or the math path that other devices use."""
    saved = ring_attention._fused
    ring_attention._fused = lambda q, v: fused and saved(q, v)
    try:
        yield
    finally:
        ring_attention._fused = saved


def test_head_tail_order_gives_each_rank_a_head_and_a_tail_chunk():
    assert head_tail_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"sequence length \(10\) divisible by 2\*3"):
        head_tail_order(10, 3)


def test_head_tail_order_refuses_a_fallback_that_would_mask_the_permuted_sequence():
    mesh = hp.mesh(cp=2, simulate=True)
    with hp.simulated(mesh), hp.context_parallel("ring", order="head_tail"), hp.region():
        q = hp.shard(torch.randn(1, 2, 8, 4), "b h s/cp d", mesh)
        with pytest.raises(RuntimeError, match="head-tail order cannot run this call: attention masks"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))


@pytest.mark.parametrize(
    "algorithm, order, message",
    [
        ("star", "contiguous", "context-parallel algorithm 'star' is not one of"),
        ("ulysses", "head_tail", "sequence order 'head_tail' is not supported by ulysses"),
        ("ring", "zigzag", "sequence order 'zigzag' is not supported by ring"),
    ],
)
def test_bad_context_parallel_choices_are_refused(algorithm, order, message):
    with pytest.raises(ValueError, match=message):
        with hp.context_parallel(algorithm, order=order):
            pass


@given(window=st.sampled_from([None, 1, 3, 6]), fused=st.booleans(), scale=st.sampled_from([0.35, 1.0]),
       cp=st.sampled_from([2, 4]))
def test_ring_attention_with_sinks_and_a_window_matches_the_eager_softmax(window, fused, scale, cp):
    """gpt-oss's eager attention: one learned logit per head joins each softmax; a query sees the keys
    less than `window` before it. Output and the q, k, v and sink gradients match."""
    from hp.ops.context_parallel import sequence_parallel_attention

    torch.manual_seed(cp + (window or 0))
    b, h, s = 2, 4, 4 * cp
    q, k, v = (torch.randn(b, h, s, 8, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, requires_grad=True)
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :]) < (window or s))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    want = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], -1).softmax(-1)[..., :-1] @ v
    grad = torch.randn_like(want)
    want.backward(grad)
    perm = head_tail_order(s, cp)
    mesh = hp.mesh(cp=cp, simulate=True)
    with block_kernels(fused), hp.simulated(mesh), hp.context_parallel("ring", order="head_tail"), hp.region():
        qs, ks, vs, gs = (hp.shard(t.detach()[:, :, perm], "b h s/cp d", mesh) for t in (q, k, v, grad))
        for t in (qs, ks, vs):
            t.requires_grad_(True)
        hs = hp.shard(sinks.detach(), "h", mesh).requires_grad_(True)
        out = sequence_parallel_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True, sinks=hs,
                                          window=window)
        out.backward(gs)
        back = torch.argsort(perm)
        got = [t.full_tensor()[:, :, back] for t in (out, qs.grad, ks.grad, vs.grad)] + [hs.grad.full_tensor()]
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, (want, q.grad, k.grad, v.grad, sinks.grad)):
        assert rel_err(g, w) < 1e-5, name

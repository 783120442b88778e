"""The NPU fused-attention kernel's bookkeeping, against a CPU stand-in for `npu_fusion_attention`.

No Ascend device is here, so the op is replaced by `reference_fusion_attention`,
a CPU implementation of its contract (layouts BNSD/BSND/BSH/SBH, `head_num`,
grouped key/value heads, causal mask, softmax max and sum of shape
(B, N, S, 8)). What is tested is hp's part: the local head count, the local
blocks, and the layouts handed back, values and gradients against one device.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import hp
from hp.ops.npu_attention import LAYOUTS, fusion_attention_on_blocks


def to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "SBH":
        t = t.transpose(0, 1)
    b, s, h = t.shape
    return t.view(b, s, heads, h // heads).transpose(1, 2)


def from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    out = t.transpose(1, 2).reshape(b, s, n * d)
    return out.transpose(0, 1) if layout == "SBH" else out


def reference_fusion_attention(query, key, value, head_num, input_layout, scale=1.0, causal=True):
    d = query.shape[-1] if input_layout in ("BNSD", "BSND") else query.shape[-1] // head_num
    kv_heads = key.shape[-1] // d if input_layout in ("BSH", "SBH") else key.shape[1 if input_layout == "BNSD" else 2]
    q, k, v = to_bnsd(query, input_layout, head_num), to_bnsd(key, input_layout, kv_heads), to_bnsd(value, input_layout, kv_heads)
    k, v = (t.repeat_interleave(head_num // kv_heads, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    row_max = scores.amax(-1)
    row_sum = (scores - row_max[..., None]).exp().sum(-1)
    out = scores.softmax(-1) @ v
    expand = lambda t: t[..., None].expand(*t.shape, 8)  # noqa: E731  (the op's (B, N, S, 8) statistics)
    return from_bnsd(out, input_layout), expand(row_max), expand(row_sum), torch.empty(0), 0, 0, 0


def global_shape(layout: str, b: int, n: int, s: int, d: int) -> tuple[int, ...]:
    return {"BNSD": (b, n, s, d), "BSND": (b, s, n, d), "BSH": (b, s, n * d), "SBH": (s, b, n * d)}[layout]


@given(layout=st.sampled_from(sorted(LAYOUTS)), dp=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]))
def test_fused_attention_runs_on_head_and_batch_blocks(layout, dp, group):
    b, heads, s, d = 2, 4, 6, 8
    kv_heads = heads // group
    torch.manual_seed(0)
    q = torch.randn(global_shape(layout, b, heads, s, d), requires_grad=True)
    k, v = (torch.randn(global_shape(layout, b, kv_heads, s, d), requires_grad=True) for _ in range(2))
    want = reference_fusion_attention(q, k, v, heads, layout, scale=d**-0.5)
    grad = torch.randn_like(want[0])
    want[0].backward(grad)
    batch, head_dim, _ = LAYOUTS[layout]
    names = ["x"] * len(q.shape)
    names[batch], names[head_dim] = ("b/dp" if dp > 1 else "b"), "n/tp"
    spec = " ".join(n if n != "x" else f"x{i}" for i, n in enumerate(names))
    mesh = hp.mesh(**({"dp": 2} if dp > 1 else {}), tp=2, simulate=True)
    with hp.simulated(mesh):
        qs, ks, vs, gs = (hp.shard(t.detach(), spec, mesh) for t in (q, k, v, grad))
        for t in (qs, ks, vs):
            t.requires_grad_(True)
        got = fusion_attention_on_blocks(reference_fusion_attention, qs, ks, vs, heads, layout, scale=d**-0.5)
        got[0].backward(gs)
        assert got[0].placements == qs.placements
        for g, w in [(got[0], want[0]), (got[1], want[1]), (got[2], want[2]), (qs.grad, q.grad), (ks.grad, k.grad),
                     (vs.grad, v.grad)]:
            torch.testing.assert_close(g.full_tensor(), w.detach(), rtol=1e-5, atol=1e-6)


def test_a_split_sequence_is_left_to_the_context_parallel_kernels():
    mesh = hp.mesh(cp=2, simulate=True)
    with hp.simulated(mesh):
        q = hp.shard(torch.randn(1, 2, 4, 8), "b n s/cp d", mesh)
        assert fusion_attention_on_blocks(reference_fusion_attention, q, q, q, 2, "BNSD") is NotImplemented

"""Attention and batched matmuls split along batch dims: on each block, with the unsharded numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from reference import explained_loss

import hp
from hp.ops.batch_dims import blockwise_attention, blockwise_matmul

MESHES = [{"tp": 2}, {"x": 2, "y": 2}]


@st.composite
def attention_cases(draw):
    sizes = draw(st.sampled_from(MESHES))
    names = list(sizes)
    b_axis = draw(st.sampled_from([None, *names]))
    h_axis = draw(st.sampled_from([None, *[n for n in names if n != b_axis]]))
    s_axis = draw(st.sampled_from([None, *[n for n in names if n not in (b_axis, h_axis)]]))
    gqa = draw(st.booleans())
    mask = draw(st.sampled_from(["none", "causal", "broadcast", "per-batch"]))
    return sizes, (b_axis, h_axis, s_axis), gqa, mask


def _layout(axes) -> str:
    return " ".join(f"{n}/{a}" if a else n for n, a in zip(("b", "h", "s", "d"), (*axes, None)))


@given(attention_cases())
def test_attention_on_blocks_gives_the_unsharded_values_and_gradients(case):
    sizes, axes, gqa, mask_kind = case
    mesh = hp.mesh(**sizes, simulate=True)
    torch.manual_seed(0)
    q = torch.randn(4, 4, 6, 8)
    k, v = torch.randn(4, 2 if gqa else 4, 6, 8), torch.randn(4, 2 if gqa else 4, 6, 8)
    mask = {"none": None, "causal": None, "broadcast": torch.randn(1, 1, 6, 6),
            "per-batch": torch.randn(4, 1, 6, 6)}[mask_kind]
    kwargs = dict(attn_mask=mask, is_causal=mask_kind == "causal", enable_gqa=gqa)
    tensors = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*tensors, **kwargs)
    want.backward(torch.ones_like(want))

    layout = _layout(axes)
    with hp.simulated(mesh):
        sharded = [hp.shard(t, layout, mesh).detach().requires_grad_() for t in (q, k, v)]
        got = blockwise_attention(*sharded, **kwargs)
        # on blocks exactly when only b and h split (a per-batch mask runs on its block)
        runs = axes[2] is None
        assert (got is not NotImplemented) == runs, (layout, mask_kind)
        if not runs:
            return
        got.backward(torch.ones_like(got))
        values = [got.full_tensor(), *(t.grad.full_tensor() for t in sharded)]
        assert got.placements == sharded[0].placements

    for g, w in zip(values, (want, *(t.grad for t in tensors))):
        torch.testing.assert_close(g, w.detach())


def test_attention_with_dropout_is_left_to_dtensor():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        q = hp.shard(torch.randn(2, 4, 3, 8), "b h/tp s d", mesh)
        assert blockwise_attention(q, q, q, dropout_p=0.1) is NotImplemented


@given(st.sampled_from(MESHES), st.integers(0, 3), st.booleans())
def test_batched_matmul_on_blocks_gives_the_unsharded_values_and_gradients(sizes, split, transposed_other):
    """Split along a batch dim: on blocks; along a contracted or output dim: left to DTensor."""
    mesh = hp.mesh(**sizes, simulate=True)
    axis = list(sizes)[0]
    torch.manual_seed(0)
    a, b = torch.randn(4, 2, 6, 8), torch.randn(4, 2, 8, 6)
    ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch.matmul(ga, gb)
    want.sum().backward()
    dims = ["b", "h", "m", "n"]
    spec = " ".join(f"{d}/{axis}" if i == split else d for i, d in enumerate(dims))
    with hp.simulated(mesh):
        x = hp.shard(a, spec, mesh).detach().requires_grad_()
        y = hp.shard(b, spec, mesh).detach().requires_grad_()
        got = blockwise_matmul(x, y)
        assert (got is not NotImplemented) == (split < 2), spec
        if got is NotImplemented:
            return
        got.sum().backward()
        values = got.full_tensor(), x.grad.full_tensor(), y.grad.full_tensor()
    for g, w in zip(values, (want, ga.grad, gb.grad)):
        torch.testing.assert_close(g, w.detach())


def test_eager_attention_runs_its_matmuls_on_blocks():
    """Gemma-2's eager attention (two matmuls) under tp: blockwise matmuls, HF's loss."""
    want, got, report = explained_loss("gemma2", {"tp": 2})
    assert abs(got - want) / want < 1e-5
    assert sum(r.op == "hp kernel blockwise_matmul" for r in report.records) == 2

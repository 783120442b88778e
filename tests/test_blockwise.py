"""Row-wise functions on each rank's block: the unsharded numbers, and DTensor's path wherever blocks would not do."""

from __future__ import annotations

import types

import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import explained_loss
from torch import nn
from transformers.models.llama import modeling_llama

import hp
from hp.ops.blockwise import blockwise

MESHES = [{"tp": 2}, {"x": 2, "y": 2}]


def _axes(draw, mesh: dict, dims: int) -> list[str | None]:
    """An axis or None per dim, no axis twice."""
    names = list(mesh)
    picks = draw(st.lists(st.sampled_from([None, *names]), min_size=dims, max_size=dims))
    seen, out = set(), []
    for p in picks:
        out.append(p if p not in seen else None)
        seen.add(p)
    return out


def _layout(names: list[str], axes: list[str | None]) -> str:
    return " ".join(f"{n}/{a}" if a else n for n, a in zip(names, axes))


def _ran_blockwise(report, name: str) -> bool:
    return any(r.op == f"hp kernel blockwise {name}" for r in report.records)


@st.composite
def norm_cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    return mesh, _axes(draw, mesh, 3)


@given(norm_cases())
def test_rms_norm_on_blocks_gives_the_unsharded_values_and_gradients(case):
    sizes, axes = case
    mesh = hp.mesh(**sizes, simulate=True)
    torch.manual_seed(0)
    x, upstream, weight = torch.randn(4, 4, 8), torch.randn(4, 4, 8), torch.randn(8)
    plain = modeling_llama.LlamaRMSNorm(8, eps=1e-6)
    plain.weight.data.copy_(weight)
    x_plain = x.clone().requires_grad_()
    (plain(x_plain) * upstream).sum().backward()

    layout = _layout(["b", "s", "h"], axes)
    with hp.simulated(mesh), hp.region():
        norm = modeling_llama.LlamaRMSNorm(8, eps=1e-6)
        norm.weight = nn.Parameter(hp.shard(weight, "h", mesh))
        norm.forward = types.MethodType(blockwise(type(norm).forward, like=(1,)), norm)
        xs = hp.shard(x, layout, mesh).detach().requires_grad_()
        report = hp.explain(lambda: (norm(xs) * hp.shard(upstream, layout, mesh)).sum())
        report.result.backward()
        out = norm(xs).full_tensor()
        grads = xs.grad.full_tensor(), norm.weight.grad.full_tensor()

    torch.testing.assert_close(out, plain(x).detach())
    torch.testing.assert_close(grads[0], x_plain.grad)
    torch.testing.assert_close(grads[1], plain.weight.grad)
    # FSDP's gathered weights stay with DTensor; split features run blockwise too, their sums all-reduced
    batch_only = axes[0] is not None and axes[1] is None and axes[2] is None
    assert _ran_blockwise(report, "LlamaRMSNorm.forward") == (not batch_only), layout


@st.composite
def rotary_cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    b, heads, s, d = _axes(draw, mesh, 4)
    cos_split = draw(st.booleans())  # cos and sin laid out with the sequence, or plain
    return mesh, (b, heads, s, d), cos_split


@given(rotary_cases())
def test_rotary_on_blocks_gives_the_unsharded_values_and_gradients(case):
    sizes, axes, cos_split = case
    mesh = hp.mesh(**sizes, simulate=True)
    torch.manual_seed(0)
    q, k = torch.randn(4, 4, 4, 8), torch.randn(4, 2 * len(sizes), 4, 8)
    cos, sin = torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    rotary = modeling_llama.apply_rotary_pos_emb
    qp, kp = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = rotary(qp, kp, cos, sin)
    (want[0].sum() + 2 * want[1].sum()).backward()

    b, heads, s, d = axes
    qk = _layout(["b", "heads", "s", "d"], axes)
    cs = _layout(["b", "s", "d"], [b, s, d])
    with hp.simulated(mesh), hp.region():
        qs = hp.shard(q, qk, mesh).detach().requires_grad_()
        ks = hp.shard(k, qk, mesh).detach().requires_grad_()
        c, n = (hp.shard(cos, cs, mesh), hp.shard(sin, cs, mesh)) if cos_split else (cos, sin)
        report = hp.explain(lambda: blockwise(rotary, like=(0, 1))(qs, ks, c, n))
        got = report.result
        (got[0].sum() + 2 * got[1].sum()).backward()
        values = [t.full_tensor() for t in (*got, qs.grad, ks.grad)]

    for g, w in zip(values, (*want, qp.grad, kp.grad)):
        torch.testing.assert_close(g, w.detach())
    # on blocks unless the rows split, plain cos and sin meet a split sequence, or the batch splits
    # (the unsqueezed dim shifts it against q's, which the dims counted from the right cannot tell)
    expected = d is None and b is None and (cos_split or s is None)
    assert _ran_blockwise(report, "apply_rotary_pos_emb") == expected, (qk, cos_split)


def test_the_zoo_runs_its_norms_and_rope_on_blocks():
    """Through `hp.apply_strategy`: tp and tp+sp run every norm and RoPE blockwise, at HF's loss."""
    for strategy in ({"tp": 2}, {"tp": 2, "sp": True}):
        want, got, report = explained_loss("llama", strategy, layers=2)
        assert abs(got - want) / want < 1e-5, strategy
        ran = [r.op for r in report.records if r.op.startswith("hp kernel blockwise")]
        assert ran.count("hp kernel blockwise LlamaRMSNorm.forward") == 2 * 2 + 1, strategy
        assert ran.count("hp kernel blockwise apply_rotary_pos_emb") == 2, strategy


def test_a_function_that_reads_a_laid_out_tensor_only_later_still_gives_its_values():
    """Planned when it read nothing laid out besides its arguments, it runs with no torch function
    seen; when a later call of that signature reads a DTensor, the result is still the DTensors' own."""
    mesh = hp.mesh(tp=2, simulate=True)
    scale: dict = {"by": None}

    def scaled(x):
        return x * (scale["by"] if scale["by"] is not None else 2.0)

    run = blockwise(scaled)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.arange(8.0).reshape(2, 4), "b/tp h", mesh)
        first = hp.explain(lambda: run(x))
        scale["by"] = hp.shard(torch.tensor([1.0, 2.0, 3.0, 4.0]), "h", mesh)
        later = hp.explain(lambda: run(x))
        values = first.result.full_tensor(), later.result.full_tensor()

    assert _ran_blockwise(first, scaled.__qualname__)
    torch.testing.assert_close(values[0], torch.arange(8.0).reshape(2, 4) * 2)
    torch.testing.assert_close(values[1], torch.arange(8.0).reshape(2, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]))

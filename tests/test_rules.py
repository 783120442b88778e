"""The rule harness: every op hp has a rule or kernel for, sharded vs one device.

Hypothesis draws shapes and layouts and checks values and gradients; the
OpInfo database's sample inputs add the edge cases PyTorch itself tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hp
from hp.ops.rule import REGISTERED, parse_factors

aten = torch.ops.aten


def sharded_vs_single(mesh, fn, tensors, layouts, rtol=1e-5, atol=1e-6, grads=True):
    """Run fn on `tensors` laid out by `layouts` and on one device; compare outputs and grads."""
    ref = [t.clone().requires_grad_(grads and t.is_floating_point()) for t in tensors]
    out_ref = fn(*ref)
    weights = torch.randn_like(out_ref) if out_ref.dim() else torch.tensor(1.0)
    if grads:
        (out_ref * weights).sum().backward()
    with hp.simulated(mesh), hp.region():
        xs = [
            hp.shard(t, lay, mesh).requires_grad_(grads and t.is_floating_point()) if lay else t
            for t, lay in zip(tensors, layouts)
        ]
        out = fn(*xs)
        if grads:
            (out * weights).sum().backward()
        torch.testing.assert_close(out.full_tensor(), out_ref, rtol=rtol, atol=atol)
        for x, r in zip(xs, ref):
            if grads and isinstance(x, torch.distributed.tensor.DTensor) and r.grad is not None:
                torch.testing.assert_close(x.grad.full_tensor(), r.grad, rtol=rtol, atol=atol)
    return out


MESHES = st.sampled_from([(("tp", 2),), (("tp", 4),), (("dp", 2), ("tp", 2)), (("cp", 2), ("tp", 2))])


@st.composite
def attention_case(draw):
    axes = draw(MESHES)
    sizes = {"b": 1, "h": 1, "s": 1}
    placed = {"b": [], "h": [], "s": []}
    for name, n in axes:
        factor = draw(st.sampled_from(["b", "h", "s", None]))
        if factor:
            placed[factor].append(name)
            sizes[factor] *= n
    b, h, s = (sizes[f] * draw(st.integers(1, 2)) for f in "bhs")
    d = draw(st.sampled_from([8, 16]))
    q_layout = " ".join(f + "".join("/" + a for a in placed[f]) for f in ("b", "h", "s")) + " d"
    kv_layout = q_layout.replace(" s" + "".join("/" + a for a in placed["s"]), " s")
    return axes, (b, h, s, d), q_layout, kv_layout, draw(st.booleans())


@given(attention_case())
def test_attention_split_over_batch_heads_or_query_sequence(case):
    axes, (b, h, s, d), q_layout, kv_layout, causal = case
    mesh = hp.mesh(list(axes), simulate=True)
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    sharded_vs_single(
        mesh,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        [q, k, v],
        [q_layout, kv_layout, kv_layout],
    )


@given(
    st.integers(1, 6), st.integers(1, 4), st.sampled_from([2, 4]), st.sampled_from(["mean", "sum", "none"]),
    st.data(),
)
def test_vocab_parallel_cross_entropy(rows, vocab_per_rank, p, reduction, data):
    n, vocab = rows * 2, vocab_per_rank * p
    target = torch.tensor(data.draw(st.lists(st.integers(-1, vocab - 1), min_size=n, max_size=n)))
    target[target < 0] = -100  # some rows ignored
    if (target == -100).all() and reduction == "mean":
        target[0] = 0
    with_dp = data.draw(st.booleans())
    mesh = hp.mesh(dp=2, tp=p, simulate=True) if with_dp else hp.mesh(tp=p, simulate=True)
    layout = "n/dp v/tp" if with_dp else "n v/tp"
    logits = torch.randn(n, vocab) * 3
    sharded_vs_single(
        mesh, lambda x: F.cross_entropy(x, target, reduction=reduction), [logits], [layout]
    )
    with hp.simulated(mesh), hp.region():
        x = hp.shard(logits, layout, mesh)
        with hp.comm.trace() as trace:
            F.cross_entropy(x, target, reduction=reduction)
    # three all-reduces of one number per local row over tp; the logits are never gathered
    local_rows = n // (2 if with_dp else 1)
    tp = trace.select(axis="tp")
    assert [(r.kind, r.payload_bytes) for r in tp] == [("all_reduce", local_rows * 4)] * 3


@pytest.mark.parametrize(
    "x_layout, w_layout",
    [("t k", "e k n/tp"), ("t k/tp", "e k/tp n"), ("t/tp k", "e k n"), ("t k", "e/tp k n")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_fp32_and_bf16(x_layout, w_layout, dtype):
    mesh = hp.mesh(tp=2, simulate=True)
    x, w = torch.randn(12, 16, dtype=dtype), torch.randn(4, 16, 16, dtype=dtype)
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
    sharded_vs_single(
        mesh, lambda x, w: torch._grouped_mm(x, w, offs=offs), [x, w], [x_layout, w_layout],
        grads=dtype == torch.float32, **tol,
    )


@pytest.mark.parametrize("residual, resolved_by", [("b s h", "all_reduce"), ("b s/tp h", "reduce_scatter")])
def test_residual_add_keeps_the_residual_layout(residual, resolved_by):
    mesh = hp.mesh(tp=2, simulate=True)
    r, x, w = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(8, 8)
    with hp.simulated(mesh), hp.region():
        partial = hp.shard(x, "b s h/tp", mesh) @ hp.shard(w, "h/tp f", mesh)
        with hp.comm.trace() as t:
            y = hp.shard(r, residual, mesh) + partial
        assert y.placements == hp.shard(r, residual, mesh).placements
        torch.testing.assert_close(y.full_tensor(), r + x @ w)
    assert [c.kind for c in t.records] == [resolved_by]


@torch.library.custom_op("hptest::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@scale_rows.register_fake
def _(x, w):
    return torch.empty_like(x)


def _scale_rows_backward(ctx, grad):
    x, w = ctx.saved_tensors
    with torch.enable_grad():
        xd, wd = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
        return torch.autograd.grad(y, (xd, wd), grad)


scale_rows.register_autograd(_scale_rows_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
hp.rule(torch.ops.hptest.scale_rows.default, "b s h, h -> b s h", whole="h")


@given(st.sampled_from(["b/tp s h", "b s/tp h", "b/dp s/tp h", "b s h/tp"]))
def test_a_custom_kernel_gets_dtensor_support_from_one_rule(layout):
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    x, w = torch.randn(4, 4, 8), torch.randn(8)
    out = sharded_vs_single(mesh, lambda x, w: scale_rows(x, w), [x, w], [layout, "h"], grads=False)
    if "h/tp" not in layout:  # a whole factor is gathered, anything else stays put
        assert hp.layout_of(out).sharded_axes == hp.layout(layout).sharded_axes


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["b s h", "b/tp s h", "b s/tp h", "b s h/tp"]), st.sampled_from(["n h", "n h/tp"]),
       st.integers(0, 2**16))
def test_masked_scatter_and_boolean_mask_reads_and_writes_keep_the_rows_in_order(layout, rows, seed):
    """Image rows scattered into a sequence, then added to again at the same positions (Qwen-VL's two uses)."""
    mesh = hp.mesh(tp=2, simulate=True)
    g = torch.Generator().manual_seed(seed)
    x, mask = torch.randn(2, 6, 4, generator=g), torch.rand(2, 6, generator=g) < 0.5
    src = torch.randn(int(mask.sum()), 4, generator=g)

    def scatter_then_add(x, src):
        h = x.masked_scatter(mask[..., None].expand_as(x), src).clone()
        h[mask, :] = h[mask, :] + src
        return h

    sharded_vs_single(mesh, scatter_then_add, [x, src], [layout, rows])


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["b h/tp s d", "b/tp h s d", "b h s/tp d", "b h s d/tp"]), st.sampled_from(["empty", "zeros"]))
def test_a_wider_buffer_keeps_its_sources_split_and_the_parts_copied_in_move_nothing(layout, factory):
    """Latent attention's keys: a buffer as wide as nope + rope, each part copied into its slice."""
    mesh = hp.mesh(tp=2, simulate=True)
    nope, rope = torch.randn(2, 4, 6, 8), torch.randn(2, 1, 6, 4)

    traces = []

    def keys(nope, rope):
        with hp.comm.trace() as t:
            made = getattr(nope, f"new_{factory}")((*nope.shape[:-1], 12))
            made[..., :8].copy_(nope)
            made[..., 8:].copy_(rope.expand(-1, nope.shape[1], -1, -1))
        traces.append(t)
        return made

    out = sharded_vs_single(mesh, keys, [nope, rope], [layout, None], grads=False)
    if "d/tp" not in layout:  # the split dim keeps its size: the buffer is split as the source, nothing moves
        assert hp.layout_of(out).sharded_axes == hp.layout(layout).sharded_axes
        assert traces[-1].count("all_gather") == 0


@pytest.mark.parametrize("layout", ["b s/tp e", "b/dp s/tp e"])
def test_gather_and_scatter_along_experts_keep_strided_token_rows_where_they_are(layout):
    """PhiMoE's router: top scores picked per token and added back in place, tokens flattened from `b s/cp`."""
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    scores = torch.randn(4, 8, 6)
    traces = []

    def pick_and_add_back(scores):
        flat = scores.view(-1, scores.shape[-1]).softmax(-1)
        index = flat.max(dim=-1, keepdim=True)[1]
        with hp.comm.trace() as t:
            picked = flat.gather(-1, index)
            added = flat.clone().scatter_add_(-1, index, picked * 2)
            out = added.scatter(-1, index, 0.5) + torch.scatter_add(flat, -1, index, picked)
        traces.append(t)
        return out

    out = sharded_vs_single(mesh, pick_and_add_back, [scores], [layout])
    assert out._local_tensor.shape[0] < out.shape[0]  # the rows stay split
    assert traces[-1].records == []


COVERED = {
    aten.masked_scatter.default,
    aten.masked_scatter_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._grouped_mm.default,
    torch.ops.hptest.scale_rows.default,
}


def test_every_registered_rule_is_covered_by_the_harness():
    builtin = {op for op in REGISTERED if op.namespace == "aten"}  # hp's own rules
    assert builtin and builtin <= COVERED, builtin - COVERED


# -- OpInfo samples ------------------------------------------------------------

def _opinfo(name):
    from torch.testing._internal.common_methods_invocations import op_db

    return next(o for o in op_db if o.name == name)


OPINFO_OPS = [
    "nn.functional.scaled_dot_product_attention", "nn.functional.cross_entropy", "softmax",
    "log_softmax", "nn.functional.layer_norm", "nn.functional.rms_norm", "topk", "gather",
    "nn.functional.embedding",
]


@pytest.mark.parametrize("name", OPINFO_OPS)
def test_opinfo_samples_split_on_the_leading_dim(name):
    op = _opinfo(name)
    mesh = hp.mesh(tp=2, simulate=True)
    checked = 0
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        if sample.kwargs.get("dropout_p", 0.0) or sample.kwargs.get("max_norm"):
            continue  # random, or renormalises the table in place: no single-device reference
        args = [sample.input, *sample.args]
        lead = sample.input.shape[0] if sample.input.dim() else 0
        if lead % 2:
            continue
        layouts = [
            ("d/tp " + " ".join(f"x{i}" for i in range(1, a.dim()))).strip()
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == lead and a.is_floating_point()
            else None
            for a in args
        ]
        want = op(*args, **sample.kwargs)
        with hp.simulated(mesh), hp.region():
            placed = [hp.shard(a, lay, mesh) if lay else a for a, lay in zip(args, layouts)]
            got = op(*placed, **sample.kwargs)
            got_flat = got if isinstance(got, (tuple, list)) else (got,)
            want_flat = want if isinstance(want, (tuple, list)) else (want,)
            for g, w in zip(got_flat, want_flat):
                g = g.full_tensor() if isinstance(g, torch.distributed.tensor.DTensor) else g
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked > 0, f"no sample of {name} could be split"


# -- bad rules and missing rules ---------------------------------------------

@pytest.mark.parametrize(
    "spec, kw, words",
    [
        ("m k, k n", {}, "needs '->'"),
        ("m k, k n -> m n", {}, "factor 'k' is missing from result 0"),
        ("m k, k n -> m n", {"sum": "k z"}, "factor 'z' of sum=/whole= is in no argument"),
    ],
)
def test_bad_rule_specs(spec, kw, words):
    with pytest.raises(hp.RuleError, match=words):
        parse_factors(spec, **kw)


@torch.library.custom_op("hptest::no_rule", mutates_args=())
def no_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@no_rule.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_without_a_rule_gets_a_clear_error():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.randn(4, 6), "b h/tp", mesh)
        with pytest.raises(hp.RuleError) as err:
            no_rule(x)
    message = str(err.value)
    assert "no sharding rule for hptest.no_rule.default" in message
    assert "f32[b=4, h=6/tp]" in message and "test_rules.py" in message and "hp.rule(" in message


def test_an_impossible_view_gets_a_clear_error_not_wrong_numbers():
    mesh = hp.mesh(tp=4, simulate=True)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.randn(2, 3, 8), "b s (heads d)/tp", mesh)
        with pytest.raises(hp.RuleError, match=r"aten.view.default cannot run on inputs f32\[b=2, s=3, \(heads d\)=8/tp\]"):
            x.view(2, 3, 2, 4)  # 2 heads cannot split over 4 ranks

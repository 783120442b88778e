"""hp.explain, hp.strict and the `hp explain` command."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import rank_pool
import torch
from hp.models import FAMILIES, plan_for
from reference import batch, tiny_pair
from torch.distributed.tensor import DTensor, Partial, Shard

import hp

ROOT = Path(__file__).parent.parent


def _mlp(mesh):
    w1 = hp.shard(torch.randn(8, 16), "h f/tp", mesh)
    w2 = hp.shard(torch.randn(16, 8), "f/tp h", mesh)
    x = hp.shard(torch.randn(4, 8), "b h", mesh)
    return x, w1, w2


def test_explain_lists_layouts_and_the_collectives_each_op_inserted():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        x, w1, w2 = _mlp(mesh)
        report = hp.explain(lambda: (torch.relu(x @ w1) @ w2).sum())
    ops = [(r.op, r.inputs, r.outputs) for r in report.records]
    assert ops[0] == ("aten.mm.default", ["f32[b=4, h=8]", "f32[h=8, f=16/tp]"], ["f32[4, 16/tp]"])
    assert ops[2] == ("aten.mm.default", ["f32[4, 16/tp]", "f32[f=16/tp, h=8]"], ["f32[4, 8] +tp"])
    summed = report.records[-1]  # the sum of a partial tensor needs no communication either
    assert summed.op == "aten.sum.default" and summed.outputs == ["f32[] +tp"]
    assert report.communicating() == []
    assert "aten.mm.default" in str(report) and "test_explain.py" in str(report)
    assert json.loads(report.to_json())[0]["op"] == "aten.mm.default"


def test_explain_attributes_implicit_collectives_to_the_op():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        a = hp.shard(torch.randn(4, 8), "b/tp h", mesh)
        b = hp.shard(torch.randn(4, 8), "b h/tp", mesh)
        report = hp.explain(lambda: a + b)
    (added,) = report.communicating()
    assert added.op == "aten.add.Tensor" and added.implicit
    assert added.collectives and all(c.axis == "tp" for c in added.collectives)
    assert added.source.startswith("test_explain.py:")


def test_strict_refuses_unrequested_redistribution_and_allows_constrain():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        a = hp.shard(torch.randn(4, 8), "b/tp h", mesh)
        b = hp.shard(torch.randn(4, 8), "b h/tp", mesh)
        with hp.strict():
            c = hp.constrain(b, "b/tp h") + a  # asked for: fine
            with pytest.raises(hp.StrictError) as err:
                a + b
        assert torch.allclose(c.full_tensor(), a.full_tensor() + b.full_tensor())
    message = str(err.value)
    assert "aten.add.Tensor" in message and "test_explain.py" in message
    assert "f32[b=4/tp, h=8], f32[b=4, h=8/tp]" in message and "hp.constrain" in message


def test_strict_passes_a_tensor_parallel_llama():
    from hp.models.llama import TP_PLAN

    mesh = hp.mesh(tp=2, simulate=True)
    _, model = tiny_pair("llama", 1)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, TP_PLAN)
        ids = torch.randint(0, 256, (2, 8))
        with hp.strict():
            loss = model(input_ids=ids, labels=ids).loss
        assert loss.shape == ()


def test_hp_explain_command_runs_a_script():
    run = rank_pool.python("-m", "hp.cli", "explain", "--json", "--communicating",
                           str(ROOT / "examples" / "annotate_mlp.py"), "--simulate", "2", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert json.loads(lines[-2])["loss_rel_err"] < 1e-5  # the script's own output
    records = json.loads(lines[-1])
    assert any(r["collectives"][0]["kind"] == "all_reduce" for r in records)


def test_explain_shows_hp_kernels_with_their_layouts_and_collectives():
    mesh = hp.mesh(x=2, y=2, simulate=True)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.randn(4, 8), "t/y h/x", mesh)
        w = hp.shard(torch.randn(6, 8), "o/y i/x", mesh)
        report = hp.explain(lambda: torch.nn.functional.linear(x, w))
    (row,) = [r for r in report.records if r.op.startswith("hp kernel")]
    assert row.op == "hp kernel linear" and not row.implicit
    assert row.inputs == ["f32[t=4/y, h=8/x]", "f32[o=6/y, i=8/x]"] and row.outputs == ["f32[4/x, 6/y]"]
    assert [(c.kind, c.axis) for c in row.collectives] == [("all_gather", "y"), ("reduce_scatter", "x")]


# -- every diagnostic sees the same, however they nest ------------------------------------------

DIAGNOSTICS = ("strict", "explain", "trace", "trace_each", "simulated")


class _Call(torch.nn.Module):
    """A module whose forward runs a function: something for hp.comm.trace_each to hook."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self):
        return self.fn()


def _nested(order, mesh, body):
    """Run body(mesh) inside the diagnostics of `order`, outermost first: (verdict, {diagnostic: records})."""
    seen = {}

    def enter(i):
        if i == len(order):
            return body(mesh)
        name, inner = order[i], lambda: enter(i + 1)
        if name == "explain":
            seen["explain"] = hp.explain(inner).records
        elif name == "trace_each":
            layer = _Call(inner)
            seen["trace_each"] = hp.comm.trace_each([layer])
            layer()
        elif name == "trace":
            with hp.comm.trace() as t:
                seen["trace"] = t
                inner()
        else:
            with hp.strict() if name == "strict" else hp.simulated(mesh):
                inner()

    try:
        enter(0)
        verdict = "passed"
    except hp.StrictError as e:
        verdict = str(e)
    seen["trace"] = seen["trace"].records
    (each,) = seen["trace_each"]
    seen["trace_each"] = each.records
    return verdict, seen


def _asked_for(mesh):
    """Communicates only where asked: in an hp kernel (the residual add) and in a constrain's backward."""
    with hp.region():
        x = hp.shard(torch.arange(32.0).reshape(4, 8), "b h", mesh).requires_grad_()
        y = hp.constrain(x, "b h/tp") + hp.shard(torch.ones(4, 8), "b h +tp", mesh)
        (y * y).sum().backward()


def _not_asked_for(mesh):
    a = hp.shard(torch.ones(4, 8), "b/tp h", mesh)
    hp.constrain(a, "b h")
    return a + hp.shard(torch.ones(4, 8), "b h/tp", mesh)


def test_strict_explain_and_traces_nest_in_any_order_inside_or_outside_simulation():
    mesh = hp.mesh(tp=2, simulate=True)
    quiet = {order: _nested(order, mesh, _asked_for) for order in itertools.permutations(DIAGNOSTICS)}
    loud = {order: _nested(order, mesh, _not_asked_for) for order in itertools.permutations(DIAGNOSTICS)}
    verdict, seen = quiet[DIAGNOSTICS]
    assert verdict == "passed"
    assert [(c.kind, c.phase) for c in seen["trace"]] == [("reduce_scatter", "forward"), ("all_gather", "backward")]
    assert seen["trace_each"] == seen["trace"] == [c for r in seen["explain"] for c in r.collectives]
    assert next(r.op for r in seen["explain"] if r.collectives) == "hp kernel residual_add"
    assert all(result == quiet[DIAGNOSTICS] for result in quiet.values())
    verdict, seen = loud[DIAGNOSTICS]
    assert verdict.startswith("hp.strict: aten.add.Tensor at test_explain.py:") and "explain" not in seen
    assert seen["trace_each"] == seen["trace"] and seen["trace"][0].kind == "all_gather" and len(seen["trace"]) > 1
    assert all(result == loud[DIAGNOSTICS] for result in loud.values())


# -- describe never raises --------------------------------------------------------------------


def test_explain_and_strict_follow_a_dim_flattened_from_two_split_dims():
    """Eager attention (Gemma-2/3) flattens batch and heads: under dp x tp a strided shard no layout names."""
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    with hp.simulated(mesh):
        q = hp.shard(torch.randn(4, 8, 16, 8), "b/dp h/tp s d", mesh)
        with hp.strict():
            report = hp.explain(lambda: q.flatten(0, 1))
    assert report.records[-1].inputs == ["f32[b=4/dp, h=8/tp, s=16, d=8]"]
    assert report.records[-1].outputs == ["f32[32/dp/tp(strided 2), 16, 8]"]


def test_describe_prints_placements_no_layout_expresses():
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    maxed = DTensor.from_local(torch.zeros(2), mesh, [Partial("max"), Shard(0)], run_check=False, shape=(4,), stride=(1,))
    assert hp.describe(maxed) == "f32[4/tp] +dp(max)"


# -- every family of the zoo ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_strict_and_explain_follow_every_familys_tensor_parallel_step(family):
    _, model = tiny_pair(family, layers=1)
    ids, labels = batch()
    strategy = hp.Strategy.of({"tp": 2})
    mesh = hp.strategy_mesh(strategy, simulate=True)
    traces = []

    def step():
        with hp.strict(), hp.comm.trace() as trace:
            traces.append(trace)
            model(input_ids=ids, labels=labels).loss.backward()

    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        report = hp.explain(step)  # strict passed: nothing moved in forward that no plan asked for
    (trace,) = traces
    assert {"hp kernel linear", "hp kernel vocab_parallel_cross_entropy"} <= {r.op for r in report.records}
    assert {r.phase for r in report.records} == {"forward", "backward"}
    assert [c for r in report.communicating() for c in r.collectives] == trace.records
    assert trace.count("all_reduce", phase="forward") >= 2 and trace.count(phase="backward") >= 2
    assert not [r.op for r in report.communicating() if r.implicit and r.phase == "forward"]

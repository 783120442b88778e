"""hp.explain, hp.strict and the `hp explain` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    from reference import tiny_pair

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
    run = subprocess.run(
        [sys.executable, "-m", "hp.cli", "explain", "--json", "--communicating",
         str(ROOT / "examples" / "annotate_mlp.py"), "--simulate", "2"],
        capture_output=True, text=True, timeout=120,
    )
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

"""hp.parallelize: plans of parameter globs, inputs and outputs, meta-device models."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import hp

PLAN = {"0.weight": "out/tp in", "0.bias": "out/tp", "2.weight": "out in/tp"}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def test_parallelized_mlp_matches_one_device():
    reference, model = _mlp(), _mlp()
    x = torch.randn(4, 8)
    reference(x).square().mean().backward()
    mesh = hp.mesh(tp=4, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, PLAN)
        assert hp.describe(model[0].weight) == "f32[out=32/tp, in=8]"
        assert hp.describe(model[2].bias) == "f32[8]"  # no entry: replicated
        with hp.comm.trace() as t:
            y = model(x)  # a plain input: replicated inside the region
        assert [r.kind for r in t.records] == []  # partial until someone needs the value
        loss = hp.constrain(y, "b h").square().mean()
        loss.backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=name)


@pytest.mark.parametrize("layout", ["b h", "b/dp h", "b s/dp h"])
def test_a_row_parallel_bias_is_added_once_and_its_tokens_stay_split(layout):
    """CodeGen's and GPT-J's down projections carry a bias: added on one rank of the pending sum
    (a split sequence, flattened with the batch by the linear, stays split too)."""
    reference, model = _mlp(), _mlp()
    x = torch.randn(4, 2, 8) if " s" in layout else torch.randn(4, 8)
    reference(x).square().mean().backward()
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, PLAN, inputs={"": (layout,)})
        with hp.comm.trace() as t:
            y = model(x)
        assert t.count("all_gather") == 0 and t.count("all_reduce") == 0, [r.kind for r in t.records]
        hp.constrain(y, layout.replace("/tp", "")).square().mean().backward()
        hp.reduce_gradients(model)
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=name)


def test_first_matching_entry_wins_and_globs_match_names():
    mesh = hp.mesh(tp=2, simulate=True)
    model = hp.parallelize(_mlp(), mesh, {"*.weight": "out/tp in", "*": "..."})
    assert hp.describe(model[2].weight) == "f32[out=8/tp, in=32]"
    assert hp.describe(model[0].bias) == "f32[32]"


def test_inputs_and_outputs_are_laid_out():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        model = hp.parallelize(
            _mlp(), mesh, PLAN, inputs={"": ("b/tp h",)}, outputs={"0": "b f/tp", "": "b/tp h"}
        )
        seen = []
        model[1].register_forward_hook(lambda m, a, out: seen.append(hp.describe(a[0])))
        y = model(torch.randn(4, 8))
        assert seen == ["f32[b=4, f=32/tp]"]  # the output layout of module "0", with its names
        assert str(hp.layout_of(y)) == "b/tp h"


def test_tied_parameters_stay_tied():
    mesh = hp.mesh(tp=2, simulate=True)
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    model = hp.parallelize(nn.ModuleDict({"emb": emb, "head": head}), mesh, {"emb.weight": "vocab/tp h"})
    assert model["emb"].weight is model["head"].weight
    assert hp.describe(model["head"].weight) == "f32[vocab=16/tp, h=8]"


@pytest.mark.parametrize("plan", [{"head.weight": "vocab/tp h"}, {"emb.weight": "vocab/tp h", "head.weight": "vocab/tp h"}])
def test_either_name_of_a_tied_parameter_lays_it_out_once(plan):
    mesh = hp.mesh(tp=2, simulate=True)
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    model = hp.parallelize(nn.ModuleDict({"emb": emb, "head": head}), mesh, plan)
    assert model["emb"].weight is model["head"].weight
    assert hp.describe(model["emb"].weight) == "f32[vocab=16/tp, h=8]"


def test_two_layouts_for_one_tied_parameter_are_refused_naming_both():
    mesh = hp.mesh(tp=2, simulate=True)
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    with pytest.raises(hp.PlanError, match=re.escape("tied parameters get different layouts ('emb.weight' -> 'vocab h/tp', "
                                                     "'head.weight' -> 'vocab/tp h')")):
        hp.parallelize(model, mesh, {"emb.weight": "vocab h/tp", "head.weight": "vocab/tp h"})
    assert not isinstance(model["emb"].weight, torch.distributed.tensor.DTensor)  # nothing was laid out


def test_meta_models_are_sharded_without_materialising():
    mesh = hp.mesh(tp=4, simulate=True)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    hp.parallelize(model, mesh, {"0.weight": "out/tp in", "0.bias": "out/tp", "2.weight": "out in/tp"})
    assert model[0].weight.device.type == "meta"
    model.to_empty(device="cpu")
    assert tuple(model[0].weight.to_local().shape) == (1024, 1024)  # a quarter of 4096 rows
    assert tuple(model[2].weight.to_local().shape) == (1024, 1024)


def test_plan_errors_name_the_parameter_or_entry():
    mesh = hp.mesh(tp=2, simulate=True)
    with pytest.raises(hp.PlanError, match=re.escape("plan entries ['*.q_proj.weight'] match no parameter")):
        hp.parallelize(_mlp(), mesh, {"*.q_proj.weight": "out/tp in"})
    with pytest.raises(hp.PlanError, match=r"parameter '0.weight' of shape \(32, 8\): .*unknown mesh axis 'cp'"):
        hp.parallelize(_mlp(), mesh, {"0.weight": "out/cp in"})
    with pytest.raises(hp.PlanError, match=r"parameter '0.weight' of shape \(32, 8\): layout has 3 dims"):
        hp.parallelize(_mlp(), mesh, {"0.weight": "a b c"})
    with pytest.raises(hp.PlanError, match="inputs entry 'nope' matches no module"):
        hp.parallelize(_mlp(), mesh, {}, inputs={"nope": "b h"})


def test_region_replicates_plain_tensors_in_lists_and_keeps_their_gradients():
    mesh = hp.mesh(tp=2, simulate=True)
    plain = torch.randn(2, 6, requires_grad=True)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.ones(2, 6), "b h/tp", mesh)
        joined = torch.cat([x, plain.detach()], dim=0)  # a plain tensor inside a list argument
        assert hp.describe(joined) == "f32[4, 6/tp]"
        (x * plain).sum().backward()  # a plain tensor that needs its gradient
    torch.testing.assert_close(plain.grad, torch.ones(2, 6))


def test_a_layout_bound_once_still_follows_the_rules_in_force():
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    with hp.simulated(mesh):
        x = hp.shard(torch.ones(4, 6), "batch h", mesh)
        assert hp.describe(hp.constrain(x, "batch h")) == "f32[batch=4, h=6]"
        with hp.rules(batch="dp"):
            assert hp.describe(hp.constrain(x, "batch h")) == "f32[batch=4/dp, h=6]"
        with hp.rules(batch="tp"):
            assert hp.describe(hp.constrain(x, "batch h")) == "f32[batch=4/tp, h=6]"

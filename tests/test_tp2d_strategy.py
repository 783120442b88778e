"""2D tensor parallel as a strategy (`tp2d`): every dense family against HF, composed with dp and cp, its bytes,
and its refusals."""

from __future__ import annotations

import pytest
import torch
from reference import BATCH, SEQ, adamw_steps_follow, assert_same_loss_and_grads, batch, laid_out_step, tiny_pair

import hp
from hp.models import FAMILIES, plan_for, tiny_config
from hp.parallel import tp_plan
from hp.parallel.strategy import StrategyError
from hp.parallel.tp2d import layer_blocks

TWO_D = {"x": 2, "y": 2}
LLAMA = [
    {"tp2d": {**TWO_D, "scheme": "summa"}}, {"tp2d": {**TWO_D, "z": 2, "scheme": "3d"}},
    {"tp2d": TWO_D, "dp": 2}, {"tp2d": {**TWO_D, "scheme": "summa"}, "dp": 2}, {"tp2d": TWO_D, "cp": 2},
    {"tp2d": TWO_D, "cp": 2, "cp_algorithm": "ring"}, {"tp2d": TWO_D, "recompute": True},
    {"tp2d": {"x": 4, "y": 2}},
]
CASES = [(f, {"tp2d": TWO_D}) for f in FAMILIES] + [("llama", s) for s in LLAMA] + [("gemma2", {"tp2d": TWO_D, "cp": 2})]


def _id(family, strategy):
    tp2d = strategy["tp2d"]
    rest = "-".join(f"{k}{v}" for k, v in strategy.items() if k != "tp2d")
    return f"{family}-{tp2d.get('scheme', '2d')}-{rest}"


def layer_forward_bytes(strategy: hp.Strategy, config) -> int:
    """One decoder layer's forward bytes per rank: `hp.tp_plan`'s 2D / SUMMA formula for its projections (forward
    is half of the step's, weight-gradient sums excluded), plus each RMSNorm's statistics (one number per local
    token, all-reduced over the axis that splits the features)."""
    t2 = strategy.tp2d
    tokens = BATCH * SEQ // strategy.dp
    blocks = layer_blocks(config)
    if t2.scheme == "summa":
        projections = tp_plan.bytes_summa(blocks, tokens, t2.x, t2.y).total // 2
        features, rows = t2.y, tokens // t2.x
    else:
        projections = tp_plan.bytes_2d(blocks, tokens, t2.x, t2.y, 1).total // 2  # z splits tokens: rows below
        projections //= t2.z
        features, rows = t2.x, tokens // (t2.y * t2.z)
    norms = 2 * hp.cost.ring_bytes("all_reduce", rows * 4, features)
    return projections + norms


@pytest.mark.parametrize("family, strategy", CASES, ids=[_id(f, s) for f, s in CASES])
def test_family_matches_hf_and_moves_the_formula_bytes(family, strategy):
    reference, model = tiny_pair(family, layers=1)
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    strategy, layers = hp.Strategy.of(strategy), []
    with laid_out_step(model, strategy, ids, labels, layers) as out:
        assert_same_loss_and_grads(out.loss, want, model, reference)
    if family in ("llama", "mistral", "qwen2") and strategy.cp == 1:  # two RMSNorms a layer, no q/k norms
        assert [t.bytes(phase="forward") for t in layers] == [layer_forward_bytes(strategy, model.config)]


def test_three_adamw_steps_give_hf_losses():
    reference, model = tiny_pair("qwen3", layers=1)
    batches = [dict(zip(("input_ids", "labels"), batch(seed=s))) for s in range(3)]
    adamw_steps_follow(reference, model, batches, {"tp2d": TWO_D, "dp": 2})


def test_the_mesh_and_world_of_a_2d_strategy():
    s = hp.Strategy(pp=2, dp=2, cp=2, tp2d={"x": 2, "y": 4}, pp_schedule="GPipe")
    assert s.mesh_axes == {"pp": 2, "dp": 2, "cp": 2, "x": 2, "y": 4} and s.world_size == 64
    assert hp.Strategy(tp2d={"x": 2, "y": 2, "z": 2, "scheme": "3d"}).mesh_axes == {"z": 2, "x": 2, "y": 2}


def test_auto_takes_the_planners_choice_for_the_models_shapes():
    config = tiny_config("llama", layers=1)
    auto = hp.Strategy(tp2d={"x": 2, "y": 2, "scheme": "auto"})
    for tokens in (64, 4096, 65536):
        choice = tp_plan.choose(layer_blocks(config), tokens, 4)
        got = auto.resolved(config, tokens)
        if choice.scheme == "1d":
            assert got.tp == 4 and got.tp2d is None
        else:
            assert (got.tp2d.scheme, got.tp2d.mesh_axes) == (choice.scheme, choice.mesh)
    assert hp.Strategy(tp2d=TWO_D).resolved(config, 64) == hp.Strategy(tp2d=TWO_D)


@pytest.mark.parametrize("spec, message", [
    ({"tp2d": TWO_D, "tp": 2}, "tp = 2 with tp2d: 2D tensor parallel replaces 1D"),
    ({"tp2d": TWO_D, "tp": 1, "sp": True}, "sp = True with tp2d: the 2D layouts already split"),
    ({"tp2d": {"x": 1, "y": 4}}, "tp2d.x = 1: expected an integer >= 2"),
    ({"tp2d": {"x": 2, "y": 2, "z": 2}}, "tp2d.z = 2: only the 3d scheme splits tokens over z"),
    ({"tp2d": {"x": 2, "y": 2, "scheme": "4d"}}, "tp2d.scheme = '4d': expected one of '2d', 'summa', '3d', 'auto'"),
    ({"tp2d": {"x": 2}}, "tp2d.y = None: missing"),
    ({"tp2d": {"x": 2, "y": 2, "w": 2}}, "tp2d.w = 2: unknown key"),
    ({"tp2d": TWO_D, "dp": 2, "ep": 2}, "ep = 2 with tp2d"),
])
def test_bad_2d_strategies_are_refused_by_field(spec, message):
    with pytest.raises(StrategyError, match=message.replace("(", r"\(").replace("'", "'")):
        hp.Strategy.of(spec)


@pytest.mark.parametrize("family, spec, message", [
    ("qwen3_moe", {"tp2d": TWO_D}, "has experts; 2D tensor parallel runs the dense decoder families"),
    ("llama", {"tp2d": {"x": 2, "y": 2, "scheme": "auto"}}, "tp2d.scheme = 'auto': decide it for the model first"),
    ("llama", {"tp2d": {"x": 2, "y": 8}}, "tp2d.y = 8 does not divide num_key_value_heads = 4"),
])
def test_what_a_model_cannot_take_is_refused_before_any_rank(family, spec, message):
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_config(family, layers=1))
    with pytest.raises(StrategyError, match=message):
        hp.check_strategy(model, spec, plan_for(model.config))

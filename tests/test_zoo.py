"""The model zoo under every strategy: loss, every gradient and every collective against HF's unsharded model."""

from __future__ import annotations

import pytest
import torch
from reference import (
    assert_same_loss_and_grads,
    batch,
    expected_layer_collectives,
    five_adamw_steps,
    laid_out_step,
    rel_err,
    tiny_pair,
)

import hp
from hp.models import FAMILIES, plan_for, plan_for_type
from hp.ops.ring_attention import head_tail_order

CORE = [{"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2}, {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"}]
LLAMA_MORE = [
    {"dp": 2, "tp": 2, "sp": True}, {"cp": 4}, {"cp": 2, "tp": 2}, {"dp": 2, "cp": 2},
    {"cp": 4, "cp_algorithm": "ring"}, {"cp": 2, "tp": 2, "cp_algorithm": "ring"},
    {"dp": 2, "cp": 2, "cp_algorithm": "ring"},
]
# Gemma-2 runs eager attention (soft-capped logits): Ulysses wraps it; ring needs SDPA and is refused. Plain dp
# (FSDP runs on gloo for every family) where the family adds to it: a tied, vocab-parallel embedding; fused weights.
PLAIN_DP = ("llama", "phi3", "gemma2")
CASES = [(f, s) for f in FAMILIES for s in CORE
         if not (f == "gemma2" and "cp_algorithm" in s) and (f in PLAIN_DP or "dp" not in s)]
CASES += [("llama", s) for s in LLAMA_MORE] + [("gemma2", {"cp": 2, "tp": 2}), ("gemma3_text", {"cp": 2, "tp": 2, "sp": True})]


@pytest.mark.parametrize("family, strategy", CASES, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for f, s in CASES])
def test_family_matches_hf_and_moves_what_megatron_moves(family, strategy):
    # one decoder layer: its input arrives laid out as a later block's would (from the embedding instead of
    # a block) and its output meets the final norm; block-to-block handoffs at 2 layers are checked under
    # strategies by tests/test_hf_models.py, tests/test_moe.py and tests/test_lora.py
    reference, model = tiny_pair(family, layers=1)
    ids, labels = batch()
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        layers = hp.comm.trace_each(model.model.layers)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, reference)
    kinds, total = expected_layer_collectives(strategy, model.config)
    for trace in layers:
        forward = trace.select(phase="forward")
        assert [(r.kind, r.axis) for r in forward] == kinds
        assert trace.bytes(phase="forward") == total


@pytest.mark.parametrize("family", FAMILIES)
def test_five_adamw_steps_under_tp_give_the_same_losses(family):
    five_adamw_steps(family, {"tp": 2})


@pytest.mark.parametrize("strategy", [{"dp": 2, "tp": 2}, {"cp": 2, "tp": 2}, {"dp": 2, "cp": 2}, {"cp": 2, "cp_algorithm": "ring"}])
def test_five_adamw_steps_under_llama_strategies_give_the_same_losses(strategy):
    five_adamw_steps("llama", strategy)


@pytest.mark.parametrize("seq", [13, 15])
@pytest.mark.parametrize(
    "family, strategy",
    [
        ("llama", {"cp": 2}), ("llama", {"cp": 2, "cp_algorithm": "ring"}), ("llama", {"cp": 4, "cp_algorithm": "ring"}),
        ("llama", {"tp": 2, "sp": True}), ("llama", {"cp": 2, "tp": 2, "sp": True, "cp_algorithm": "ring"}),
    ],
)
def test_sequences_not_divisible_by_the_chunk_count_are_padded_without_changing_the_numbers(family, strategy, seq):
    reference, model = tiny_pair(family, layers=1)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, -3:] = -100
    out = reference(input_ids=ids, labels=labels)
    out.loss.backward()
    strategy = hp.Strategy.of(strategy)
    with laid_out_step(model, strategy, ids, labels) as got:
        assert_same_loss_and_grads(got.loss, out.loss, model, reference)
        logits = got.logits.full_tensor()
    padded = seq + (-seq % strategy.sequence_chunks)
    assert logits.shape[1] == padded
    if strategy.ring:  # logits come back in head-tail order
        logits = logits[:, torch.argsort(head_tail_order(padded, strategy.cp))]
    assert rel_err(logits[:, :seq], out.logits) < 1e-5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_mask": torch.tensor([[1] * 8, [0] * 2 + [1] * 6])}, "padding masks are not supported under context"),
        ({"position_ids": torch.arange(8)[None]}, "position_ids are not supported under context parallelism"),
    ],
)
def test_cp_refuses_masks_and_positions_it_cannot_honour(kwargs, message):
    _, model = tiny_pair("llama", layers=1)
    strategy = {"cp": 2, "cp_algorithm": "ring"}
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        with pytest.raises(ValueError, match=message):
            model(input_ids=torch.zeros(2, 8, dtype=torch.long), **kwargs)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"tp": 2, "zp": 2}, r"zp = 2: unknown strategy key; expected one of dp, cp, tp, sp"),
        ({"cp": 2, "cp_algorithm": "star"}, r"cp_algorithm = 'star': expected one of 'ulysses', 'ring'"),
        ({"dp": 2, "fsdp": True, "param_dtype": "fp8"}, r"param_dtype = 'fp8': expected one of 'float32', 'bfloat16', "
                                                        r"'float16' or null"),
        ({"dp": 2, "fsdp": True, "reshard_after_forward": "no"}, r"reshard_after_forward = 'no': expected true or f"),
        ({"dp": 2, "reduce_dtype": "float32"}, r"reduce_dtype = 'float32': only FSDP has this option; set fsdp true"),
        ({"cp": 2, "reshard_after_forward": False}, r"reshard_after_forward = False: only FSDP has this option"),
        ({"tp": 2, "fsdp": True, "param_dtype": "bfloat16"}, r"param_dtype = 'bfloat16': FSDP has no ranks to shard "
                                                             r"over \(dp x cp = 1\), so it does not run"),
        ({"tp": 0}, r"tp = 0: expected an integer >= 1"),
        ({"sp": "yes"}, r"sp = 'yes': expected true or false"),
        ({"ep": 2}, r"ep = 2 does not divide dp = 1"),
    ],
)
def test_bad_strategies_are_refused_with_the_key(spec, message):
    with pytest.raises(hp.StrategyError, match=message):
        hp.strategy_mesh(spec, simulate=True)


def test_fsdp_shards_over_dp_and_cp_and_takes_fsdp2_options():
    """FSDP with cp is a strategy (run on gloo processes: FSDP2 cannot run simulated); its options round-trip."""
    spec = {"dp": 2, "cp": 2, "tp": 2, "fsdp": True, "reshard_after_forward": False, "param_dtype": "bfloat16",
            "reduce_dtype": "float32"}
    strategy = hp.Strategy.of(spec)
    assert strategy.fsdp_axes == ("dp", "cp") and hp.Strategy.of(strategy.as_dict()) == strategy
    assert hp.Strategy(cp=2, fsdp=True, cp_algorithm="ring").fsdp_axes == ("cp",)
    assert hp.Strategy(dp=2, cp=2).fsdp_axes == () and hp.Strategy(tp=2, fsdp=True).fsdp_axes == ()


def test_shapes_a_strategy_cannot_take_are_refused_before_any_model_is_built():
    config = tiny_pair("gemma2", layers=1)[0].config
    with pytest.raises(hp.StrategyError, match=r"tp = 3 does not divide num_attention_heads = 8"):
        hp.Strategy(tp=3).check_fits(config)
    with pytest.raises(hp.StrategyError, match=r"cp = 8 \(Ulysses\) does not divide the 4 heads per tp rank"):
        hp.Strategy(cp=8).check_fits(config)
    with pytest.raises(hp.StrategyError, match=r"cp_algorithm = 'ring' cannot soft-cap attention logits"):
        hp.Strategy(cp=2, cp_algorithm="ring").check_fits(config)


def test_an_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"no model plan for model_type 'gpt2': hp derives plans for the causal LMs "
                                         r"whose transformers model carries a tensor- or pipeline-parallel plan; those are .*\bllama, "):
        plan_for_type("gpt2")


def test_a_plan_is_data_and_the_llama_style_families_derive_one_plan():
    assert plan_for_type("llama") == plan_for_type("gemma2") == plan_for_type("mistral")
    assert plan_for_type("phi3").params["*.self_attn.qkv_proj.weight"] == "[q k v]/tp in"
    assert hash(plan_for_type("llama")) == hash(plan_for_type("qwen3"))


def test_ring_attention_is_refused_for_a_model_without_sdpa_attention():
    _, model = tiny_pair("gemma2", layers=1, attn_logit_softcapping=None)
    strategy = {"cp": 2, "cp_algorithm": "ring"}
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh), pytest.raises(hp.StrategyError, match=r"ring attention needs SDPA attention \(or eager "
                                           r"attention with learned sinks\), and this Gemma2ForCausalLM runs "
                                           r"'eager' attention; use cp_algorithm ulysses"):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))


def test_a_plan_that_does_not_fit_the_model_is_refused_without_a_mesh():
    """Phi-3 with fewer key/value heads than query heads: its fused q, k, v parts are unequal."""
    from transformers import AutoModelForCausalLM

    from hp.models import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("phi3", layers=1, num_key_value_heads=4))
    with pytest.raises(hp.PlanError, match=r"parameter 'model.layers.0.self_attn.qkv_proj.weight' of shape \(128, 64\): "
                                           r"dimension 0 has size 128, not divisible into its 3 equal parts"):
        hp.check_strategy(model, {"tp": 2}, plan_for_type("phi3"))  # the plan of Phi-3's equal parts
    hp.check_strategy(model, {"cp": 2}, plan_for_type("phi3"))  # without tp nothing is split in parts
    assert "*.self_attn.qkv_proj.weight" not in plan_for(model.config).params  # derived for it: q, k, v left whole


@pytest.mark.parametrize("strategy", [{"dp": 2}, {"dp": 2, "tp": 2}])
def test_padded_batches_split_over_dp_give_hf_s_loss_and_gradients(strategy):
    """A padding mask that differs by example, with the batch split over dp: each rank's attention takes its own
    examples' rows of the mask (no all-gather of q, k and v), and the loss and every gradient are HF's. (FSDP
    shards the parameters, not the attention, which runs as under dp; FSDP runs on real ranks in
    tests/workers/zoo_gloo.py.)"""
    reference, model = tiny_pair("llama", layers=1)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :5] = 0
    labels = labels.masked_fill(mask == 0, -100)
    want = reference(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        got.loss.backward()
        hp.reduce_gradients(model)
        assert_same_loss_and_grads(got.loss, want.loss, model, reference)

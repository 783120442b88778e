"""Pipeline parallel: the cost-balanced split, the strategy's checks, and steps equal to the unsharded one."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import rank_pool
from gloo_launch import assert_finished
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

import hp
from hp.parallel.pipeline import Skipped, cut, stages_of_rank
from hp.parallel.pipeline_split import BlockCosts, StageSplit, balanced_split, even_split
from hp.parallel.strategy import StrategyError
from tests.reference import tiny_pair

HERE = Path(__file__).parent


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=9), st.floats(0.0, 5.0), st.floats(0.0, 30.0),
       st.integers(1, 9))
def test_the_balanced_split_is_the_best_contiguous_one(blocks, embedding, head, stages):
    """Against every split there is: no other contiguous split has a cheaper most expensive stage."""
    stages = min(stages, len(blocks))
    costs = BlockCosts(embedding, tuple(blocks), head)
    split = balanced_split(costs, stages)
    assert split.stages == stages and all(n >= 1 for n in split.counts) and sum(split.counts) == len(blocks)
    worst = max(split.cost(costs, s) for s in range(stages))
    for cuts in itertools.combinations(range(1, len(blocks)), stages - 1):
        other = StageSplit((0, *cuts, len(blocks)))
        assert worst <= max(other.cost(costs, s) for s in range(stages)) + 1e-9


def test_a_large_vocabulary_moves_blocks_out_of_the_last_stage():
    """Llama-3-8B's shapes, 8 layers over 4 stages: the head and loss cost what 2-3 layers cost."""
    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, num_hidden_layers=8)
    costs = BlockCosts.of(config, seq=8192)
    balanced, even = balanced_split(costs, 4), even_split(8, 4)
    assert even.counts == (2, 2, 2, 2) and balanced.counts[-1] < 2
    slowest = [max(s.cost(costs, i) for i in range(4)) for s in (balanced, even)]
    assert slowest[0] < 0.8 * slowest[1]


def test_stages_per_rank_follow_the_schedule():
    assert stages_of_rank(hp.Strategy(pp=2, pp_schedule="DualPipeV"), 0) == [0, 3]
    assert stages_of_rank(hp.Strategy(pp=2, pp_schedule="LoopedBFS", pp_stages_per_rank=3), 1) == [1, 3, 5]


def test_a_cut_stage_keeps_only_its_blocks_under_their_own_names():
    _, model = tiny_pair("llama", layers=4)
    plan = hp.models.plan_for(model.config)
    cut(model, plan, StageSplit.of_counts([1, 3]), 1)
    names = {n.split(".weight")[0] for n, _ in model.named_parameters()}
    assert isinstance(model.model.embed_tokens, Skipped) and isinstance(model.model.layers[0], Skipped)
    assert "model.layers.3.mlp.down_proj" in names and "lm_head" in names and "model.norm" in names
    assert not any(n.startswith(("model.embed_tokens", "model.layers.0.")) for n in names)


@pytest.mark.parametrize("spec, words", [
    ({"pp": 2, "pp_schedule": "zigzag"}, "pp_schedule = 'zigzag': expected one of 'GPipe', '1F1B'"),
    ({"pp_microbatches": 4}, "pp_microbatches = 4: only pipeline parallel has this option"),
    ({"pp": 4, "pp_microbatches": 2}, "pp_microbatches = 2: fewer micro-batches than pp = 4 stages"),
    ({"pp": 2, "pp_schedule": "GPipe", "pp_stages_per_rank": 2}, "the GPipe schedule runs 1 stage per rank"),
    ({"pp": 2, "pp_split": (3, 1, 1)}, "pp_split = (3, 1, 1): 3 stages given, but pp = 2 x 1 per rank makes 2"),
    ({"pp": 2, "pp_split": (4, 0)}, "each >= 1"),
    ({"pp": 2, "dp": 2, "fsdp": True, "pp_schedule": "ZBVZeroBubble"}, "use 1F1B or Interleaved1F1B with fsdp"),
    ({"pp": 2, "offload": "disk"}, "offload = 'disk' with pp: not available yet"),
])
def test_bad_pipeline_strategies_are_refused_by_name(spec, words):
    with pytest.raises(StrategyError, match=re.escape(words)):
        hp.Strategy(**spec)


@pytest.mark.parametrize("spec, config, words", [
    ({"pp": 4, "pp_schedule": "Interleaved1F1B"}, {}, "makes 8 stages for num_hidden_layers = 4"),
    ({"pp": 2, "pp_split": (1, 2)}, {}, "pp_split = (1, 2): 3 blocks given, the model has num_hidden_layers = 4"),
    ({"pp": 2}, {"output_router_logits": True}, "router auxiliary loss"),
])
def test_a_pipeline_the_model_cannot_take_is_refused_by_name(spec, config, words):
    with pytest.raises(StrategyError, match=re.escape(words)):
        hp.Strategy(**spec).check_fits(AutoConfig.for_model("llama", num_hidden_layers=4, **config))


def test_every_schedule_and_family_gives_the_unsharded_loss_and_gradients_on_two_gloo_processes():
    """GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; Qwen3-MoE,
    Gemma2 (tied head, soft-capped logits), GPT-NeoX; uneven -100 labels over the micro-batches."""
    run = rank_pool.run(str(HERE / "workers" / "pipeline_gloo.py"), 2, timeout=300)
    assert_finished(run)
    assert len(re.findall(r"pipelines follow the unsharded model", run.stdout)) == 2


def test_2d_tensor_parallel_within_stages_and_within_fsdp_gives_the_unsharded_step_on_eight_gloo_processes():
    run = rank_pool.run(str(HERE / "workers" / "pipeline_gloo.py"), 8, timeout=300)
    assert_finished(run)
    assert len(re.findall(r"pipelines follow the unsharded model", run.stdout)) == 8


def test_stages_laid_out_with_tp_sp_dp_fsdp_cp_and_ep_give_the_unsharded_step_on_four_gloo_processes():
    run = rank_pool.run(str(HERE / "workers" / "pipeline_gloo.py"), 4, timeout=300)
    assert_finished(run)
    assert len(re.findall(r"pipelines follow the unsharded model", run.stdout)) == 4

"""The preference stages over real processes: the DPO quickstart learns, every stage takes the unsharded steps.

Every loss and layout meets the unsharded computation in tests/test_preference.py (simulated ranks), and every
stage, LoRA, FSDP, cp and tp for 5 AdamW steps in tests/workers/preference_gloo.py, run here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import rank_pool
from gloo_launch import assert_finished
from train_runs import ROOT, WORKERS, hp_train, local_hf_model, losses, summary

QUICKSTART_DPO = str(ROOT / "examples" / "quickstart_dpo.yaml")
# Weights after a few AdamW steps agree to lr / 50 (the quickstart's lr is 2e-3), not to fp32's 1e-5: AdamW moves
# each weight by about lr whatever its gradient's size, so an entry whose gradient nearly cancels carries the
# summation order's rounding into its step at full size (measured: 2.06e-5 apart in a placed KTO run on one machine).
ADAM_ATOL = 4e-5
SHORT = ["max_steps=5", "logging_steps=1", "save_steps=5", "parallel.tp=1"]


def test_the_dpo_quickstart_prefers_the_right_answers(tmp_path):
    # on one process (its tp=2 run takes the same steps: the gloo worker below checks tp; here it saves a third)
    result = summary(hp_train(f"output_dir={tmp_path}", "parallel.tp=1", config=QUICKSTART_DPO))
    assert result["steps"] == 200
    assert result["rewards"]["rewards/accuracies"] >= 0.9, result["rewards"]
    with open(tmp_path / "metrics.jsonl") as f:
        margins = [r["rewards/margins"] for r in map(json.loads, f)]
    assert margins[0] == 0.0 < margins[len(margins) // 2] < margins[-1], margins  # the policy starts as its reference
    assert result["last_loss"] < result["first_loss"] / 10


def test_every_stage_and_lora_take_the_unsharded_steps_on_gloo_processes():
    run = rank_pool.run(str(WORKERS / "preference_gloo.py"), 2, timeout=600)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1"]


def test_a_reward_model_trains_and_exports_its_value_head_as_llamafactory_does(tmp_path):
    from safetensors.torch import load_file

    result = summary(hp_train(*SHORT, "stage=rm", "per_device_train_batch_size=8", f"output_dir={tmp_path / 'run'}",
                              config=QUICKSTART_DPO))
    assert result["steps"] == 5 and 0 <= result["rewards"]["rewards/accuracies"] <= 1
    run = rank_pool.python("-m", "hp.cli", "export", str(tmp_path / "run" / "checkpoint-5"), str(tmp_path / "out"),
                           timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    head = load_file(Path(tmp_path / "out" / "value_head.safetensors"))
    assert sorted(head) == ["v_head.summary.bias", "v_head.summary.weight"]
    assert head["v_head.summary.weight"].shape == (1, 128)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the language model loads as a plain HF one
    assert not any("v_head" in name for name, _ in model.named_parameters())


def test_a_placed_reference_has_the_plain_runs_losses_rewards_and_weights_and_resumes(tmp_path):
    """`parallel.mpmd: {place: {reference: ...}}` (hp.mpmd's level 3): DPO's reference a batch ahead in a
    2-stage policy's bubbles (the policy's backward split: `zero_bubble`), on a rank of its own beside a whole policy, wherever the costs measured
    before the model is cut say (auto), in two data parallel replicas of one rank each, and with both models
    laid out tp=2 over two ranks (the placement's two planes), against one plain worker, with
    two accumulated batches a step: the same losses and rewards step by step (the last planned from the
    measured costs) and the same weights in the checkpoint; the second placement, resumed from its step-2
    checkpoint (its reference rank holds none of the policy), takes the same last steps. The model is a
    Qwen2 directory saved by HF with its head tied to its embedding: a 2-stage policy holds it twice, and
    each copy gets both gradients."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp.train.checkpoint import load_model_weights

    local_hf_model(tmp_path / "tied", "qwen2", tied=True)
    run = ["max_steps=4", "save_steps=2", "logging_steps=1", "per_device_train_batch_size=4",
           "gradient_accumulation_steps=2", "warmup_ratio=0", "parallel.tp=1",
           f"model_name_or_path={tmp_path / 'tied'}"]
    places = {"pp": ["parallel.pp=2", "parallel.mpmd={place: {reference: pp}, zero_bubble: true}"],
              "own": ["parallel.pp=1", "parallel.mpmd={place: {reference: 1}}"],
              "auto": ["parallel.pp=2", "parallel.mpmd={place: {reference: auto}}"],
              "dp": ["parallel.pp=1", "parallel.dp=2", "parallel.mpmd={place: {reference: pp}}",
                     "per_device_train_batch_size=2"],  # two replicas, each half of every batch's pairs
              "tp": ["parallel.pp=1", "parallel.tp=2", "parallel.mpmd={place: {reference: pp}}"]}
    plain = summary(hp_train(*run, f"output_dir={tmp_path / 'plain'}", config=QUICKSTART_DPO))
    want = losses(tmp_path / "plain")
    for name, place in places.items():
        got = summary(hp_train(*run, *place, f"output_dir={tmp_path / name}", config=QUICKSTART_DPO))
        assert got["mpmd_place"]["planned_from_costs"], got
        chosen = got["mpmd_place"].get("chosen")  # auto: how the two ranks were shared, and why
        if name == "auto":
            assert chosen["where"] == min(chosen["predicted_step_s"], key=chosen["predicted_step_s"].get), chosen
        where = chosen["where"] if chosen else {"pp": "shared", "own": "own", "dp": "replicas", "tp": "replicas"}[name]
        want_ranks = {"shared": [0, 1], "own": [1], "replicas": [0]}[where]  # each replica's, from its first rank
        assert got["mpmd_place"]["programs"]["reference"] == want_ranks, got
        assert losses(tmp_path / name) == pytest.approx(want, rel=1e-5), name
        assert got["rewards"] == pytest.approx(plain["rewards"], rel=1e-4, abs=1e-6), (name, got["rewards"])
    resumed = tmp_path / "own" / "resumed"
    summary(hp_train(*run, *places["own"], f"output_dir={resumed}",
                     f"resume_from_checkpoint={tmp_path / 'own' / 'checkpoint-2'}", config=QUICKSTART_DPO))
    assert losses(resumed) == pytest.approx({s: v for s, v in want.items() if s > 2}, rel=1e-5)
    weights = {}
    for name in ("plain", "pp", "own", "tp"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "plain" / "checkpoint-4"))
        load_model_weights(str(tmp_path / name / "checkpoint-4"), model)
        weights[name] = model.state_dict()
    for name in ("pp", "own", "tp"):
        for key, value in weights["plain"].items():
            assert torch.allclose(weights[name][key], value, rtol=1e-5, atol=ADAM_ATOL), (name, key)


def test_a_placed_kto_reference_has_the_plain_runs_losses_rewards_and_weights(tmp_path):
    """KTO under `parallel.mpmd: {place: {reference: ...}}`: each batch's reference point gathered from the
    policy's forward of its mismatched pairs (a program of its own in the step), the reference a batch ahead
    in a 2-stage policy's bubbles and on a rank of its own, against one plain worker, two accumulated batches a
    step: the same losses, rewards and reference points step by step, and the same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp.train.checkpoint import load_model_weights

    run = ["stage=kto", "dataset=quickstart_kto", "pref_ftx=0.2", "kto_rejected_weight=1.5", "max_steps=4",
           "save_steps=4", "logging_steps=1", "per_device_train_batch_size=4", "gradient_accumulation_steps=2",
           "warmup_ratio=0", "parallel.tp=1"]
    places = {"pp": ["parallel.pp=2", "parallel.mpmd={place: {reference: pp}}"],
              "own": ["parallel.pp=1", "parallel.mpmd={place: {reference: 1}}"]}
    plain = summary(hp_train(*run, f"output_dir={tmp_path / 'plain'}", config=QUICKSTART_DPO))
    want = losses(tmp_path / "plain")
    assert plain["rewards"]["kl"] > 0, plain["rewards"]  # the reference points count
    for name, place in places.items():
        got = summary(hp_train(*run, *place, f"output_dir={tmp_path / name}", config=QUICKSTART_DPO))
        assert got["mpmd_place"]["planned_from_costs"], got
        assert got["mpmd_place"]["programs"]["kl"] == got["mpmd_place"]["programs"]["policy"], got
        assert losses(tmp_path / name) == pytest.approx(want, rel=1e-5), name
        assert got["rewards"] == pytest.approx(plain["rewards"], rel=1e-4, abs=1e-6), (name, got["rewards"])
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "plain" / "checkpoint-4"))
        load_model_weights(str(tmp_path / name / "checkpoint-4"), model)
        plain_model = AutoModelForCausalLM.from_config(model.config)
        load_model_weights(str(tmp_path / "plain" / "checkpoint-4"), plain_model)
        for (key, value), mine in zip(plain_model.state_dict().items(), model.state_dict().values()):
            off = (mine - value).abs() - 1e-5 * value.abs()
            worst = int(off.argmax())
            assert torch.allclose(mine, value, rtol=1e-5, atol=ADAM_ATOL), \
                (name, key, mine.flatten()[worst].item(), value.flatten()[worst].item())


@pytest.mark.parametrize("overrides, words", [
    (["stage=kto", "parallel.pp=1", "parallel.dp=2", "parallel.mpmd={place: {reference: pp}}"],
     "parallel.mpmd.place.reference = 'pp' with stage = 'kto' and parallel.dp = 2: KTO's reference point"),
    (["stage=rm"], "with stage = 'rm': that stage has no reference model to place"),
    (["pref_loss=simpo"], "with pref_loss = 'simpo': that loss compares with no reference model"),
    (["parallel.mpmd={place: {reference: 1}}"], "mpmd.place.reference = 1: the reference is cut into the policy's "
                                                "pp = 2 stages"),
    (["parallel.mpmd={place: {reference: pp, vision: pp}}"], "places one sub-model at a time"),
    (["parallel.cp=2"], "parallel.cp = 2 with mpmd.place: a placed program's stages are laid out over tp alone"),
    (["parallel.mpmd={place: {reference: auto}}", "parallel.pp_split=[1, 1]"],
     "parallel.pp_split = (1, 1) with mpmd.place.reference = 'auto': the pipeline's stages depend on the choice"),
], ids=["kto with replicas", "rm", "reference-free loss", "own ranks not pp", "two sub-models", "cp", "auto with a split"])
def test_a_reference_placement_that_cannot_run_is_named_before_any_worker(overrides, words):
    from hp.train.config import ConfigError, load_config

    placed = ["parallel.tp=1", "parallel.pp=2", "parallel.mpmd={place: {reference: pp}}"]
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(QUICKSTART_DPO, [*placed, *overrides])

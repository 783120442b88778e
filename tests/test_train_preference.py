"""The preference stages over real processes: the DPO quickstart learns, every stage takes the unsharded steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gloo_launch import assert_finished, clean_env, torchrun
from train_runs import ROOT, WORKERS, hp_train, losses, summary

QUICKSTART_DPO = str(ROOT / "examples" / "quickstart_dpo.yaml")
# Five steps of 8 pairs (or answers) in one process; a layout over two ranks splits the same global batches.
SHORT = ["max_steps=5", "logging_steps=1", "save_steps=5", "parallel.tp=1"]
STAGES = {"rm": ["stage=rm"]}
LAYOUTS = {"fsdp-dp2": ["parallel.dp=2", "parallel.fsdp=true", "per_device_train_batch_size=4"]}
# Every loss and layout meets the unsharded computation in tests/test_preference.py (simulated ranks), and every
# stage, LoRA, cp and tp for 5 steps in tests/workers/preference_gloo.py; this runs `hp train` itself.
CASES = [("rm", "fsdp-dp2")]


def test_the_dpo_quickstart_prefers_the_right_answers(tmp_path):
    result = summary(hp_train(f"output_dir={tmp_path}", config=QUICKSTART_DPO))
    assert result["steps"] == 200
    assert result["rewards"]["rewards/accuracies"] >= 0.9, result["rewards"]
    with open(tmp_path / "metrics.jsonl") as f:
        margins = [r["rewards/margins"] for r in map(json.loads, f)]
    assert margins[0] == 0.0 < margins[len(margins) // 2] < margins[-1], margins  # the policy starts as its reference
    assert result["last_loss"] < result["first_loss"] / 10


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each stage's five steps in one process, on one device (what every layout must reproduce): its output_dir."""
    runs = {}

    def run(stage: str) -> Path:
        if stage not in runs:
            out = tmp_path_factory.mktemp(stage)
            summary(hp_train(*SHORT, *STAGES[stage], "per_device_train_batch_size=8", f"output_dir={out}",
                             config=QUICKSTART_DPO))
            runs[stage] = out
        return runs[stage]

    return run


@pytest.mark.parametrize("stage, layout", CASES, ids=[f"{s}-{layout}" for s, layout in CASES])
def test_a_preference_stage_trains_as_one_process_does(stage, layout, one_process, tmp_path):
    result = summary(hp_train(*SHORT, *STAGES[stage], *LAYOUTS[layout], f"output_dir={tmp_path}",
                              config=QUICKSTART_DPO))
    assert result["steps"] == 5 and "rewards/margins" in result["rewards"]
    want, got = losses(one_process(stage)), losses(tmp_path)
    assert list(got) == list(want) == [1, 2, 3, 4, 5]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)


def test_every_stage_and_lora_take_the_unsharded_steps_on_gloo_processes():
    run = torchrun(str(WORKERS / "preference_gloo.py"), 2, timeout=600)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1"]


def test_a_reward_model_exports_its_value_head_as_llamafactory_does(one_process, tmp_path):
    from safetensors.torch import load_file

    run = subprocess.run([sys.executable, "-m", "hp.cli", "export", str(one_process("rm") / "checkpoint-5"),
                          str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    head = load_file(Path(tmp_path / "out" / "value_head.safetensors"))
    assert sorted(head) == ["v_head.summary.bias", "v_head.summary.weight"]
    assert head["v_head.summary.weight"].shape == (1, 128)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the language model loads as a plain HF one
    assert not any("v_head" in name for name, _ in model.named_parameters())

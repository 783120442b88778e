"""The preference stages over real processes: the DPO quickstart learns, every stage takes the unsharded steps.

Every loss and layout meets the unsharded computation in tests/test_preference.py (simulated ranks), and every
stage, LoRA, FSDP, cp and tp for 5 AdamW steps in tests/workers/preference_gloo.py, run here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import rank_pool
from gloo_launch import assert_finished, clean_env
from train_runs import ROOT, WORKERS, hp_train, summary

QUICKSTART_DPO = str(ROOT / "examples" / "quickstart_dpo.yaml")
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
    run = subprocess.run([sys.executable, "-m", "hp.cli", "export", str(tmp_path / "run" / "checkpoint-5"),
                          str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    head = load_file(Path(tmp_path / "out" / "value_head.safetensors"))
    assert sorted(head) == ["v_head.summary.bias", "v_head.summary.weight"]
    assert head["v_head.summary.weight"].shape == (1, 128)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the language model loads as a plain HF one
    assert not any("v_head" in name for name, _ in model.named_parameters())

"""LlamaFactory's example configs (restated in examples/llamafactory) through `hp train`, as given.

Each runnable config trains 2 steps on a tiny local Qwen3 directory (Qwen3-VL
for qwen3vl_*; the only keys changed are model_name_or_path, dataset_dir,
output_dir and max_steps) over small datasets in LlamaFactory's demo formats
and names (mllm_demo's pictures drawn with Pillow); each config that needs
what hp does not have stops before any worker with one message that lists
every key in the way.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from PIL import Image
from train_runs import QWEN_TOKENS, ROOT, TINY_QWEN3_VL_PROCESSOR, hp_train, local_hf_model, local_vl_model, summary

import hp.cli

EXAMPLES = ROOT / "examples" / "llamafactory"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3")
    local_hf_model(directory, "qwen3", **QWEN_TOKENS)
    return directory


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_vl")
    local_vl_model(directory)
    return directory


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """identity, alpaca_en_demo, c4_demo, dpo_en_demo, kto_en_demo and mllm_demo in LlamaFactory's formats, named
    in a dataset_info.json as LlamaFactory names them."""
    data = tmp_path_factory.mktemp("data")
    (data / "mllm_demo_data").mkdir()
    for k, size in enumerate([(640, 480), (200, 150), (96, 128)]):  # the first over the qwen3vl example's bound
        Image.effect_noise(size, 40 + 20 * k).convert("RGB").save(data / "mllm_demo_data" / f"{k + 1}.jpg")
    mllm = [{"messages": [{"role": "user", "content": f"<image>Who are they? ({i})"},
                          {"role": "assistant", "content": f"Picture {i % 3 + 1}."}],
             "images": [f"mllm_demo_data/{i % 3 + 1}.jpg"]} for i in range(6)]
    (data / "mllm_demo.json").write_text(json.dumps(mllm))
    identity = [{"instruction": q, "input": "", "output": f"I am {{{{name}}}}, made by {{{{author}}}}. ({q})"}
                for q in ("hi", "who are you?", "what is your name?", "introduce yourself")] * 4
    alpaca = [{"instruction": f"add {i} and {i + 1}", "input": "", "output": f"{2 * i + 1}"} for i in range(24)]
    (data / "identity.json").write_text(json.dumps(identity))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca))
    (data / "c4_demo.jsonl").write_text("".join(json.dumps({"text": f"document {i}: " + "words " * 30}) + "\n"
                                                for i in range(16)))
    pairs = [{"conversations": [{"from": "human", "value": f"what is {i} + {i}?"}],
              "chosen": {"from": "gpt", "value": f"{2 * i}"}, "rejected": {"from": "gpt", "value": f"{2 * i + 1}"}}
             for i in range(16)]
    feedback = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                              {"role": "assistant", "content": f"{2 * i + i % 2}"}], "label": i % 2 == 0}
                for i in range(16)]
    (data / "dpo_en_demo.json").write_text(json.dumps(pairs))
    (data / "kto_en_demo.json").write_text(json.dumps(feedback))
    (data / "dataset_info.json").write_text(json.dumps({
        "identity": {"file_name": "identity.json"},
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
        "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
        "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
        "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                        "columns": {"messages": "messages", "kto_tag": "label"},
                        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                 "assistant_tag": "assistant"}},
        "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}},
    }))
    return data


@pytest.mark.parametrize("name, noted", [("qwen3_full_sft", True), ("qwen3_full_sft_fsdp2", True),
                                         ("qwen3_lora_sft", False)])  # every key of the LoRA one is taken as is
def test_an_sft_example_runs_as_given(name, noted, qwen3, demo_data, tmp_path):
    run = hp_train(f"model_name_or_path={qwen3}", f"dataset_dir={demo_data}", f"output_dir={tmp_path}", "max_steps=2",
                   config=str(EXAMPLES / f"{name}.yaml"))
    result = summary(run)
    assert result["steps"] == 2 and result["last_loss"] > 0
    assert (tmp_path / "checkpoint-2").is_dir()
    # what was made of its keys is said
    assert ("has no effect here" in run.stderr or "note:" in run.stderr) == noted, run.stderr[-2000:]


@pytest.mark.parametrize("name", ["qwen3vl_full_sft"])
def test_a_vision_example_runs_as_given(name, qwen3_vl, demo_data, tmp_path):
    """Images from mllm_demo and text from identity and alpaca_en_demo, read at the config's image_max_pixels and
    the Qwen3-VL directory's processor file, with the config's template and freeze keys."""
    run = hp_train(f"model_name_or_path={qwen3_vl}", f"dataset_dir={demo_data}", f"output_dir={tmp_path}",
                   "max_steps=2", config=str(EXAMPLES / f"{name}.yaml"))
    result = summary(run)
    assert result["steps"] == 2 and math.isfinite(result["last_loss"]) and result["last_loss"] > 0
    assert (tmp_path / "checkpoint-2").is_dir()
    assert "video_max_pixels = 16384 has no effect here (hp train reads no video" in run.stderr, run.stderr[-2000:]


def test_a_bad_processor_file_stops_the_qwen3vl_example_before_any_worker(qwen3_vl, demo_data, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(qwen3_vl, model)
    (model / "preprocessor_config.json").write_text(json.dumps({**TINY_QWEN3_VL_PROCESSOR, "image_std": [0.5, 0, 0.5]}))
    code = hp.cli.main(["train", str(EXAMPLES / "qwen3vl_full_sft.yaml"), f"model_name_or_path={model}",
                        f"dataset_dir={demo_data}", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{model / 'preprocessor_config.json'}: image_std = [0.5, 0, 0.5] is not taken" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["qwen3_lora_dpo"])
def test_a_preference_example_runs_as_given(name, qwen3, demo_data, tmp_path):
    run = hp_train(f"model_name_or_path={qwen3}", f"dataset_dir={demo_data}", f"output_dir={tmp_path}", "max_steps=2",
                   config=str(EXAMPLES / f"{name}.yaml"))
    result = summary(run)
    assert result["steps"] == 2 and result["last_loss"] > 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(result["rewards"])
    assert (tmp_path / "checkpoint-2" / "adapter_config.json").is_file()


@pytest.mark.parametrize("name, stage", [("qwen3_lora_kto", "kto"), ("qwen3_lora_reward", "rm")])
def test_the_kto_and_reward_examples_pass_every_check_before_the_workers(name, stage, qwen3, demo_data, tmp_path):
    """Their keys are the DPO one's but for the stage and data (kto_en_demo's layout read here); their stages train
    in tests/test_train_preference.py and tests/workers/preference_gloo.py."""
    from hp.train import preflight
    from hp.train.config import load_config

    config = load_config(EXAMPLES / f"{name}.yaml", [f"model_name_or_path={qwen3}", f"dataset_dir={demo_data}",
                                                     f"output_dir={tmp_path}"])
    preflight.check(config)
    assert config.stage == stage and config.finetuning.lora is not None


@pytest.mark.parametrize("name, keys", [
    ("llama3_full_sft_galore", ["use_galore = True", "galore_layerwise = True", "galore_rank = 128", "pure_bf16 = True"]),
])
def test_an_example_needing_what_hp_lacks_lists_every_key_before_any_worker(name, keys, qwen3, demo_data, tmp_path,
                                                                           capsys):
    code = hp.cli.main(["train", str(EXAMPLES / f"{name}.yaml"), f"model_name_or_path={qwen3}",
                        f"dataset_dir={demo_data}", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    problems = err.splitlines()[1:] if len(keys) > 1 else err.splitlines()
    assert len(problems) == len(keys) and err.startswith("hp train: ")
    for key, problem in zip(keys, problems):
        assert key in problem, (key, err)
    assert not (tmp_path / "out").exists()


def test_deepspeed_offload_is_refused_by_name(qwen3, demo_data, tmp_path, capsys):
    code = hp.cli.main(["train", str(EXAMPLES / "qwen3_full_sft.yaml"), f"model_name_or_path={qwen3}",
                        f"dataset_dir={demo_data}", f"output_dir={tmp_path / 'out'}",
                        "deepspeed=examples/deepspeed/ds_z3_offload_config.json"])
    err = capsys.readouterr().err
    assert code == 2 and "zero_optimization.offload_optimizer" in err and "not available yet" in err, err

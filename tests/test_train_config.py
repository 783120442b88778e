"""`hp train`'s configuration layer: good configs round-trip, overrides apply, bad configs fail by name."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from hp.train import config as config_module
from hp.parallel.strategy import Strategy
from hp.parallel.tp2d import TP2D
from hp.train.config import ConfigError, TrainConfig, apply_overrides, load_config, to_dict, validate

MINIMAL = {"model_name_or_path": "hp/tiny-llama", "dataset": "alpaca_en_demo", "output_dir": "saves/tiny"}

# A LlamaFactory-style SFT file with a parallel section, as a user writes it (1e-5 is a string to PyYAML).
GOOD_YAML = """\
### model
model_name_or_path: hp/tiny-llama

### method
stage: sft
do_train: true

### dataset
dataset: alpaca_en_demo, identity
template: alpaca
cutoff_len: 512

### output
output_dir: saves/tiny/sft
logging_steps: 5
save_steps: 100
save_total_limit: 2
plot_loss: true
overwrite_output_dir: true

### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 1e-5
num_train_epochs: 2
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true

### parallel
parallel:
  dp: 2
  tp: 2
  sp: true
"""


def _write(tmp_path: Path, text: str, name: str = "train.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_config_round_trips(tmp_path):
    cfg = load_config(_write(tmp_path, GOOD_YAML))
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.num_train_epochs == 2.0 and isinstance(cfg.num_train_epochs, float)
    assert cfg.dataset == "alpaca_en_demo,identity" and cfg.datasets == ("alpaca_en_demo", "identity")
    assert (cfg.template, cfg.cutoff_len, cfg.save_total_limit, cfg.bf16) == ("alpaca", 512, 2, True)
    assert cfg.parallel == Strategy(dp=2, tp=2, sp=True, recompute=True)
    assert cfg.nproc_per_node == 4 and cfg.world_size == 4

    plain = to_dict(cfg)
    assert validate(yaml.safe_load(yaml.safe_dump(plain))) == cfg
    assert validate(json.loads(json.dumps(plain))) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learning_rate = 1.0


def test_defaults_are_llamafactorys():
    cfg = validate(MINIMAL)
    assert to_dict(cfg) == {
        **MINIMAL, "stage": "sft", "do_train": True, "trust_remote_code": False, "image_max_pixels": 768 * 768,
        "finetuning_type": "full",
        "lora_rank": 8, "lora_alpha": None, "lora_dropout": 0.0, "lora_target": "all", "additional_target": None,
        "use_rslora": False, "freeze_trainable_layers": 2, "freeze_trainable_modules": "all",
        "freeze_extra_modules": None, "freeze_vision_tower": True, "freeze_multi_modal_projector": True, "freeze_language_model": False,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "dataset_dir": "data", "template": None, "cutoff_len": 2048, "max_samples": None,
        "default_system": None, "train_on_prompt": False, "mask_history": False, "enable_thinking": True,
        "preserve_thinking": False,
        "pref_beta": 0.1, "pref_ftx": 0.0, "pref_loss": "sigmoid", "dpo_label_smoothing": 0.0, "simpo_gamma": 0.5,
        "kto_chosen_weight": 1.0, "kto_rejected_weight": 1.0, "ref_model": None,
        "preprocessing_num_workers": None, "dataloader_num_workers": 0, "report_to": [], "logging_dir": None,
        "fsdp_transformer_layer_cls_to_wrap": None,
        "val_size": 0.0, "eval_dataset": None, "do_eval": False, "eval_strategy": "no", "eval_steps": None,
        "per_device_eval_batch_size": 8,
        "overwrite_output_dir": False, "logging_steps": 500, "save_steps": 500, "save_total_limit": None,
        "save_only_model": False, "async_save": True,
        "plot_loss": False, "resume_from_checkpoint": None, "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1, "learning_rate": 5e-5, "num_train_epochs": 3.0, "max_steps": -1,
        "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "bf16": False, "seed": 42,
        "disable_gradient_checkpointing": False, "torch_compile": False,
        "parallel": {k: v for k, v in Strategy(recompute=True).as_dict().items()
                     if k not in ("mpmd_place", "mpmd_zero_bubble")},  # written as mpmd: {place: ...} when set
        "use_hyper_parallel": False, "hyper_parallel_args": None, "hyper_parallel_cp_size": None,
        "deepspeed": None, "fsdp": None, "fsdp_config": None,
        "nproc_per_node": 1, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": None,
        "ddp_timeout": 1800, "max_restarts": 0, "device": "auto", "cluster": None,
    }


@pytest.mark.parametrize("raw, recompute", [
    ({}, True),  # LlamaFactory checkpoints gradients unless told not to
    ({"disable_gradient_checkpointing": True}, False),
    ({"parallel": {"recompute": False}}, False),
    ({"disable_gradient_checkpointing": True, "parallel": {"activation_mode": "none"}}, False),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"activation_mode": "recompute"}}, True),
])
def test_activation_recompute_as_llamafactory_sets_it(raw, recompute):
    assert validate({**MINIMAL, **raw}).parallel.recompute is recompute


@pytest.mark.parametrize("raw", [{"torch_compile": True}, {"parallel": {"compile": True}},
                                 {"torch_compile": True, "parallel": {"compile": True}}])
@pytest.mark.parametrize("split", [{}, {"tp": 2}, {"dp": 2, "fsdp": True}, {"dp": 2, "ep": 2}])
def test_compiled_blocks_as_llamafactorys_torch_compile_or_parallel_compile_ask(raw, split):
    """Compiled blocks recompute by LlamaFactory's default under every strategy."""
    raw = {**raw, "parallel": {**raw.get("parallel", {}), **split}, "nproc_per_node": 2}
    strategy = validate({**MINIMAL, **raw}).parallel
    assert strategy.compile and strategy.recompute


def test_pipeline_keys_and_the_ranks_they_take():
    cfg = validate({**MINIMAL, "parallel": {"pp": 2, "tp": 2, "pp_schedule": "GPipe"}, "nproc_per_node": 8})
    assert cfg.parallel == Strategy(pp=2, tp=2, dp=2, pp_schedule="GPipe", recompute=True)
    assert cfg.parallel.mesh_axes == {"pp": 2, "dp": 2, "tp": 2}


def test_2d_keys_and_the_ranks_they_take():
    cfg = validate({**MINIMAL, "parallel": {"tp2d": {"x": 2, "y": 2, "z": 2, "scheme": "3d"}}, "nproc_per_node": 16,
                    "per_device_train_batch_size": 4})
    assert cfg.parallel.tp2d == TP2D(x=2, y=2, z=2, scheme="3d") and cfg.parallel.dp == 2
    assert cfg.parallel.mesh_axes == {"dp": 2, "z": 2, "x": 2, "y": 2}
    assert validate(to_dict(cfg)) == cfg  # the checkpoint's copy of the config reads back


def test_compiled_blocks_offload():
    parallel = validate({**MINIMAL, "parallel": {"compile": True, "offload": "disk"}}).parallel
    assert parallel.compile and parallel.offload == "disk" and not parallel.recompute


@pytest.mark.parametrize("offload", ["disk", {"budget": 0.3, "tiers": ["device", "disk"]}, {"budget": 0.3}])
def test_offload_is_a_tier_or_a_budget_and_tiers_and_replaces_llamafactorys_recompute(offload):
    parallel = validate({**MINIMAL, "parallel": {"tp": 2, "offload": offload}}).parallel
    budget = offload.get("budget", 0.5) if isinstance(offload, dict) else 0.5
    assert parallel == Strategy(tp=2, offload="disk", offload_budget=budget, recompute=False)


@pytest.mark.parametrize("raw", [
    {"parallel": {"activation_mode": "swap"}},
    {"use_hyper_parallel": True, "hyper_parallel_args": {"activation_mode": "swap", "activation_swap_inputs": False}},
])
def test_hyper_parallels_swap_is_offload_to_the_disk_tier_at_the_default_budget(raw):
    assert validate({**MINIMAL, **raw}).parallel == Strategy(offload="disk", recompute=False)


def test_the_parallel_section_is_the_strategy_every_plan_takes():
    parallel = validate({**MINIMAL, "parallel": {"cp": 2, "tp": 2, "cp_algorithm": "ring"}}).parallel
    assert parallel == Strategy(cp=2, tp=2, cp_algorithm="ring", recompute=True)


def test_expert_parallel_splits_the_data_parallel_ranks_nproc_per_node_leaves():
    cfg = validate({**MINIMAL, "nproc_per_node": 4,
                    "parallel": {"ep": 2, "tp": 2, "expert_bias_rate": "1e-3"}})
    assert cfg.parallel == Strategy(dp=2, ep=2, tp=2, expert_bias_rate=0.001, recompute=True)
    assert cfg.parallel.mesh_axes == {"ep": 2, "tp": 2} and cfg.world_size == 4
    assert validate(to_dict(cfg)) == cfg
    hyper = validate({**MINIMAL, "nproc_per_node": 4, "use_hyper_parallel": True,
                      "hyper_parallel_args": {"ep_size": 2, "tp_size": 2, "token_dispatcher": "all_to_all"}})
    assert (hyper.parallel.dp, hyper.parallel.ep, hyper.parallel.tp, hyper.parallel.fsdp) == (2, 2, 2, True)


def test_overrides(tmp_path):
    path = _write(tmp_path, GOOD_YAML)
    cfg = load_config(path, ["parallel.tp=1", "parallel.dp=4", "bf16=false", "learning_rate=3e-4",
                             "dataset=identity", "save_total_limit=null", "max_steps=10", "parallel.fsdp=true"])
    assert cfg.parallel == Strategy(dp=4, tp=1, sp=True, fsdp=True, recompute=True)
    assert (cfg.bf16, cfg.learning_rate, cfg.dataset, cfg.save_total_limit, cfg.max_steps) == (False, 3e-4, "identity", None, 10)
    assert cfg.nproc_per_node == 4

    cfg = load_config(_write(tmp_path, yaml.safe_dump(MINIMAL), "minimal.yaml"), ["parallel.tp=2", "bf16=true"])
    assert (cfg.parallel.tp, cfg.bf16, cfg.nproc_per_node) == (2, True, 2)


def test_overrides_leave_the_input_alone():
    raw = {**MINIMAL, "parallel": {"dp": 2}}
    out = apply_overrides(raw, ["parallel.tp=2"])
    assert out["parallel"] == {"dp": 2, "tp": 2} and raw["parallel"] == {"dp": 2}


@pytest.mark.parametrize("override, words", [
    ("bf16", "override 'bf16': expected KEY=VALUE"),
    ("=1", "override '=1': expected KEY=VALUE"),
    ("training.lr=1", "SECTION one of parallel, hyper_parallel_args"),
    ("parallel.tp.x=1", "SECTION one of parallel, hyper_parallel_args"),
    ("parallel.=1", "SECTION one of parallel, hyper_parallel_args"),
])
def test_bad_overrides(override, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        apply_overrides(MINIMAL, [override])


def test_multinode_derives_nproc_per_node():
    cfg = validate({**MINIMAL, "parallel": {"dp": 4, "tp": 2}, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1"})
    assert (cfg.nproc_per_node, cfg.world_size) == (4, 8)
    assert validate({**MINIMAL, "parallel": {"dp": 4, "tp": 2}, "nnodes": 2, "nproc_per_node": 4}) == dataclasses.replace(
        cfg, node_rank=0, master_addr="127.0.0.1")


HYPER = {"tp_size": 2, "fsdp_size": 2, "activation_mode": "none"}


def test_hyper_parallel_args_as_dict():
    cfg = validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": HYPER})
    assert cfg.parallel == Strategy(dp=2, tp=2, fsdp=True)  # activation_mode none: no recompute
    assert cfg.nproc_per_node == 4 and dict(cfg.hyper_parallel_args) == HYPER
    assert validate(to_dict(cfg)) == cfg
    # the same degree in both places is fine; fsdp_size 1 asks for nothing
    same = validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": {**HYPER, "cp_size": 1},
                     "parallel": {"tp": 2, "dp": 2, "sp": True}})
    assert same.parallel == Strategy(dp=2, tp=2, sp=True, fsdp=True)
    assert validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": {"fsdp_size": 1}}).parallel == Strategy(recompute=True)
    assert validate({**MINIMAL, "use_hyper_parallel": True}).parallel == Strategy(recompute=True)


@pytest.mark.parametrize("extra, strategy, note", [
    # fsdp_size unset: FSDP over every rank tp leaves; dp fills the launched ranks
    ({"nproc_per_node": 4}, Strategy(dp=4, fsdp=True), "FSDP over all 4 dp * cp ranks"),
    ({"nproc_per_node": 4, "hyper_parallel_args": {"cp_size": 2}}, Strategy(dp=2, cp=2, fsdp=True), "dp * cp ranks"),
    # the top-level hyper_parallel_cp_size replaces cp_size, as LlamaFactory does
    ({"nproc_per_node": 4, "hyper_parallel_args": {"cp_size": 4}, "hyper_parallel_cp_size": 2},
     Strategy(dp=2, cp=2, fsdp=True), "hyper_parallel_cp_size = 2 replaces hyper_parallel_args.cp_size = 4"),
    ({"hyper_parallel_args": {"fsdp_size": 4, "cp_size": 2, "tp_size": 2}}, Strategy(dp=2, cp=2, tp=2, fsdp=True), ""),
    ({"nproc_per_node": 2, "hyper_parallel_args": {"fsdp_size": 1}}, Strategy(dp=2), ""),
    ({"nproc_per_node": 2, "hyper_parallel_args": {"param_dtype": "bf16", "reduce_dtype": "float32",
                                                   "reshard_after_forward": False}},
     Strategy(dp=2, fsdp=True, param_dtype="bfloat16", reduce_dtype="float32", reshard_after_forward=False), ""),
])
def test_hyper_parallel_as_llamafactory_runs_it(extra, strategy, note):
    hyper = {"hyper_parallel_args": {"activation_mode": "none", **extra.pop("hyper_parallel_args", {})}}
    cfg = validate({**MINIMAL, "use_hyper_parallel": True, **hyper, **extra})
    assert cfg.parallel == strategy
    assert cfg.nproc_per_node == strategy.world_size
    assert note in " ".join(cfg.notes)
    assert validate(to_dict(cfg)).parallel == cfg.parallel


@pytest.mark.parametrize("extra, strategy, note", [
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, Strategy(dp=4, fsdp=True), "ZeRO-3 runs as FSDP"),
    ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}},
     Strategy(dp=4, fsdp=True, reshard_after_forward=False), "ZeRO-2 runs as FSDP with reshard_after_forward false"),
    ({"deepspeed": {"zero_optimization": {"stage": 0}}}, Strategy(dp=4), "ZeRO-0 runs as plain data parallel"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}},
     Strategy(dp=2, tp=2, fsdp=True, reshard_after_forward=False), "AutoTP as tp = 2"),
    ({"deepspeed": {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "bf16": {"enabled": True},
                    "zero_optimization": {"stage": 3}}, "bf16": True}, Strategy(dp=4, fsdp=True), ""),
    ({"fsdp": "full_shard auto_wrap"}, Strategy(dp=4, fsdp=True), "fsdp: runs as FSDP over the data-parallel ranks"),
    ({"fsdp": ["shard_grad_op"]}, Strategy(dp=4, fsdp=True, reshard_after_forward=False), "reshard_after_forward"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": "false",
                                            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
     Strategy(dp=4, fsdp=True, reshard_after_forward=False), ""),
    ({"fsdp": "no_shard"}, Strategy(dp=4), "plain data parallel"),
    ({"fsdp_config": {"version": 2}}, Strategy(dp=4), "fsdp_config: has no effect without fsdp"),
])
def test_deepspeed_and_hf_fsdp_keys_map_to_the_strategy(extra, strategy, note):
    cfg = validate({**MINIMAL, "nproc_per_node": 4, "disable_gradient_checkpointing": True, **extra})
    assert cfg.parallel == strategy
    assert note in " ".join(cfg.notes)
    assert validate(to_dict(cfg)) == cfg


def test_an_unset_finetuning_type_is_said_to_differ_from_llamafactorys():
    assert any("finetuning_type unset: LlamaFactory's default is lora" in n for n in validate(MINIMAL).notes)
    assert not validate({**MINIMAL, "finetuning_type": "full"}).notes


def test_hyper_parallel_cp_size_at_its_default_needs_no_hyper_parallel():
    assert validate({**MINIMAL, "hyper_parallel_cp_size": 1}).parallel.cp == 1


@pytest.mark.parametrize("value, names, note", [
    ("none", (), ""), ("tensorboard", ("tensorboard",), ""), ("all", ("tensorboard",), ""),
    (["wandb", "tensorboard"], ("wandb", "tensorboard"), "report_to: wandb is not written to"),
])
def test_report_to_writes_tensorboard_and_notes_the_other_trackers(value, names, note):
    cfg = validate({**MINIMAL, "report_to": value})
    assert cfg.report_to == names and note in " ".join(cfg.notes)


def test_deepspeed_json_is_found_next_to_the_config(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    path = _write(tmp_path, yaml.safe_dump({**MINIMAL, "deepspeed": "ds/z3.json", "nproc_per_node": 2}))
    monkeypatch.chdir("/")
    cfg = load_config(path)
    assert cfg.parallel.fsdp and cfg.parallel.dp == 2
    assert cfg.notes[0] == "deepspeed (z3.json): ZeRO-3 runs as FSDP over the data-parallel ranks"


def test_hyper_parallel_args_as_json_file(tmp_path, monkeypatch):
    (tmp_path / "hp.json").write_text(json.dumps({"cp_size": 2, "tp_size": 2}))
    text = yaml.safe_dump({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": "hp.json"})
    path = _write(tmp_path, text)
    monkeypatch.chdir("/")  # a relative path is found next to the config file too
    cfg = load_config(path)
    # FSDP over every rank tp leaves (the 2 cp ranks), as LlamaFactory runs fsdp_size unset
    assert cfg.parallel == Strategy(cp=2, tp=2, fsdp=True, recompute=True) and cfg.nproc_per_node == 4
    assert dict(cfg.hyper_parallel_args) == {"cp_size": 2, "tp_size": 2}
    # from the current directory, and with an override reaching into the file's keys
    monkeypatch.chdir(tmp_path)
    cfg = validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": str(tmp_path / "hp.json")})
    assert cfg.parallel.cp == 2
    cfg = load_config(path, ["hyper_parallel_args.cp_size=1", "parallel.sp=true"])
    assert cfg.parallel == Strategy(tp=2, sp=True, recompute=True) and cfg.nproc_per_node == 2


@pytest.mark.parametrize("content, words", [
    ("{not json", "does not read as JSON"),
    ("[1, 2]", "expected a JSON object in"),
    ('{"tp_size": 0}', "hyper_parallel_args.tp_size = 0: expected an integer >= 1"),
])
def test_bad_hyper_parallel_json(tmp_path, content, words):
    (tmp_path / "hp.json").write_text(content)
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": str(tmp_path / "hp.json")})


def test_missing_hyper_parallel_json(tmp_path):
    with pytest.raises(ConfigError, match=r"hyper_parallel_args = '.*nope\.json': expected the path of a JSON file"):
        validate({**MINIMAL, "use_hyper_parallel": True, "hyper_parallel_args": str(tmp_path / "nope.json")})


# (changes to MINIMAL, words the message must contain); None as a value removes the key.
BAD = [
    # unknown keys, with the closest known one
    ({"learnig_rate": 1e-4}, "unknown key 'learnig_rate' = 0.0001; did you mean 'learning_rate'?"),
    ({"lr": 1e-4}, "unknown key 'lr' = 0.0001; did you mean 'learning_rate'?"),
    ({"tp": 2}, "unknown key 'tp' = 2; did you mean 'parallel.tp'?"),
    ({"parallel": {"tensor": 2}}, "unknown key 'parallel.tensor' = 2; expected one of dp, tp, cp"),
    ({"parallel": {"tp_size": 2}}, "unknown key 'parallel.tp_size' = 2; did you mean 'parallel.tp'?"),
    ({"parallel": {"fsdp_sise": 2}}, "unknown key 'parallel.fsdp_sise' = 2; did you mean 'parallel.fsdp'?"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"tp_sise": 2}},
     "unknown key 'hyper_parallel_args.tp_sise' = 2; did you mean 'hyper_parallel_args.tp_size'?"),
    ({"finetuning_type": "oft"}, "finetuning_type = 'oft': expected one of 'full', 'lora', 'freeze'"),
    ({"lora_rank": 0}, "lora_rank = 0: expected an integer >= 1"),
    ({"lora_dropout": 1}, "lora_dropout = 1: expected a probability in [0, 1)"),
    ({"freeze_trainable_layers": 0}, "freeze_trainable_layers = 0: expected a non-zero integer"),
    ({"max_grad_norm": 0}, "max_grad_norm = 0: expected a number > 0, or null for no clipping"),
    ({"max_samples": 0}, "max_samples = 0: expected an integer >= 1, or null for every record"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"ep_style": "etp"}},
     "hyper_parallel_args.ep_style = 'etp': expected one of 'ep' (hp splits whole experts over ep"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"plan_overrides": {}}},
     "hyper_parallel_args.plan_overrides = {} is not taken by hp train yet (hp's model plans are data"),
    # missing required keys
    ({"model_name_or_path": None}, "missing required key 'model_name_or_path'"),
    ({"dataset": None}, "missing required key 'dataset'"),
    ({"output_dir": None}, "missing required key 'output_dir'"),
    # wrong types
    ({"learning_rate": "fast"}, "learning_rate = 'fast': expected a finite number"),
    ({"learning_rate": True}, "learning_rate = True: expected a finite number"),
    ({"warmup_ratio": ".nan"}, "warmup_ratio = '.nan': expected a finite number"),
    ({"cutoff_len": "1024"}, "cutoff_len = '1024': expected an integer"),
    ({"save_steps": 1.5}, "save_steps = 1.5: expected an integer"),
    ({"bf16": "yes please"}, "bf16 = 'yes please': expected true or false"),
    ({"plot_loss": 1}, "plot_loss = 1: expected true or false"),
    ({"model_name_or_path": 7}, "model_name_or_path = 7: expected a string"),
    ({"dataset": ["a", "b"]}, "dataset = ['a', 'b']: expected a string"),
    ({"parallel": [2, 2]}, "parallel = [2, 2]: expected a mapping"),
    ({"parallel": {"sp": "on"}}, "parallel.sp = 'on': expected true or false"),
    ({"nproc_per_node": "eight"}, "nproc_per_node = 'eight': expected an integer, or null"),
    # out of range
    ({"learning_rate": -1e-4}, "learning_rate = -0.0001: expected a number > 0"),
    ({"learning_rate": "0"}, "learning_rate = '0': expected a number > 0"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size = 0: expected an integer >= 1"),
    ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps = -2: expected an integer >= 1"),
    ({"warmup_ratio": 1.0}, "warmup_ratio = 1.0: expected a number in [0, 1)"),
    ({"warmup_ratio": -0.1}, "warmup_ratio = -0.1: expected a number in [0, 1)"),
    ({"cutoff_len": 1}, "cutoff_len = 1: expected an integer >= 2"),
    ({"num_train_epochs": -1}, "num_train_epochs = -1: expected a number >= 0"),
    ({"max_steps": -5}, "max_steps = -5: expected a positive integer, or -1"),
    ({"logging_steps": 0}, "logging_steps = 0: expected an integer >= 1"),
    ({"save_total_limit": 0}, "save_total_limit = 0: expected an integer >= 1, or null"),
    ({"seed": -1}, "seed = -1: expected an integer in [0, 2**32)"),
    ({"master_port": 70000}, "master_port = 70000: expected a port in [1, 65535]"),
    ({"nnodes": 0}, "nnodes = 0: expected an integer >= 1"),
    ({"parallel": {"tp": 0}}, "parallel.tp = 0: expected an integer >= 1"),
    ({"dataset": "alpaca,,identity"}, "dataset = 'alpaca,,identity': expected comma-separated dataset names"),
    ({"resume_from_checkpoint": " "}, "resume_from_checkpoint = ' ': expected a checkpoint directory, 'last', or null"),
    ({"output_dir": ""}, "output_dir = '': expected a directory"),
    # values outside a set
    ({"stage": "ppo"}, "stage = 'ppo': expected one of 'pt', 'sft', 'rm', 'dpo', 'kto' (LlamaFactory's ppo is not "
                       "available yet)"),
    ({"pref_loss": "orpo"}, "pref_loss = 'orpo' with stage = 'sft': the preference keys act in stages rm, dpo, kto "
                            "only; expected their defaults, or a preference stage"),
    ({"stage": "dpo", "pref_loss": "bco_pair"}, "pref_loss = 'bco_pair': expected one of 'sigmoid', 'hinge', 'ipo', "
                                                "'simpo', 'orpo'"),
    ({"stage": "dpo", "pref_beta": 0}, "pref_beta = 0: expected a number > 0"),
    ({"stage": "dpo", "val_size": 0.1, "eval_strategy": "steps"}, "stage = 'dpo' with evaluation"),
    ({"stage": "dpo", "pref_loss": "simpo", "ref_model": "m"}, "that loss needs no reference model"),
    ({"stage": "rm", "ref_model": "m"}, "a reward model has no reference"),
    ({"parallel": {"mpmd": 0}}, "parallel.mpmd = 0: expected a number of chunks >= 1, 'auto', {chunks: N}, "
                                "{place: {vision: pp or N}}, {place: {reference: pp or N}} (with zero_bubble: true, the "
                                "pipeline's backward split), or null"),
    ({"parallel": {"mpmd": {"chunk": 2}}}, "parallel.mpmd = {'chunk': 2}: expected a number of chunks"),
    ({"parallel": {"mpmd": {"chunks": 2, "zero_bubble": True}}}, "parallel.mpmd = {'chunks': 2, 'zero_bubble': True}: "
                                                                 "expected a number of chunks"),
    ({"parallel": {"pp": 2, "mpmd": {"zero_bubble": True}}}, "mpmd.zero_bubble = True: only a placed step (mpmd.place) "
                                                            "splits its pipeline's backward"),
    ({"parallel": {"pp": 2, "mpmd": {"place": {"vision": "pp"}, "zero_bubble": 1}}},
     "parallel.mpmd.zero_bubble = 1: expected true or false"),
    ({"lr_scheduler_type": "polynomial"},
     "lr_scheduler_type = 'polynomial': expected one of 'linear', 'cosine', 'constant', 'constant_with_warmup'"),
    ({"template": "llama30"}, "template = 'llama30': expected one of 'default', 'empty', 'alpaca', 'chatml', 'qwen'"),
    ({"device": "tpu"}, "device = 'tpu': expected one of 'auto', 'cpu', 'cuda', 'npu'"),
    ({"max_restarts": -1}, "max_restarts = -1: expected an integer >= 0 (restarts from the last complete checkpoint)"),
    ({"parallel": {"cp_algorithm": "zigzag"}}, "parallel.cp_algorithm = 'zigzag': expected one of 'ulysses', 'ring'"),
    ({"do_train": False}, "do_train = False: expected true (only training is available yet)"),
    # rules between keys
    ({"num_train_epochs": 0, "max_steps": -1}, "num_train_epochs = 0.0 with max_steps = -1: nothing would train"),
    ({"num_train_epochs": 0, "max_steps": 0}, "num_train_epochs = 0.0 with max_steps = 0: nothing would train"),
    ({"warmup_ratio": 0.1, "lr_scheduler_type": "constant"}, "warmup_ratio = 0.1 with lr_scheduler_type = 'constant'"),
    ({"nnodes": 2, "node_rank": 2, "parallel": {"dp": 2}}, "node_rank = 2: expected an integer in [0, nnodes = 2)"),
    ({"parallel": {"dp": 2, "tp": 2}, "nproc_per_node": 8},
     "nproc_per_node = 8: expected 4, as nnodes * nproc_per_node must equal dp*cp*tp = 2*1*2 = 4"),
    ({"parallel": {"dp": 3}, "nnodes": 2}, "nnodes = 2: the dp*cp*tp = 3*1*1 = 3 ranks do not split evenly"),
    # features not built yet, and what the Llama zoo refuses
    ({"parallel": {"ep": 4}}, "parallel.ep = 4 does not divide dp = 1: expert parallel splits the data-parallel ranks"),
    ({"parallel": {"ep": 2, "tp": 2}, "nproc_per_node": 6},
     "parallel.ep = 2 does not divide the data-parallel ranks: nproc_per_node = 6 (x nnodes = 1) with cp = 1 and "
     "tp = 2 leaves dp = 6 / (cp * tp) = 3"),
    ({"parallel": {"expert_bias_rate": -0.1}}, "parallel.expert_bias_rate = -0.1: expected a number >= 0"),
    ({"parallel": {"expert_bias_rate": "fast"}}, "parallel.expert_bias_rate = 'fast': expected a finite number"),
    ({"parallel": {"tp2d": True}}, "parallel.tp2d = True: expected {x: N, y: N, z: N (3d only), scheme: 2d | summa"),
    ({"parallel": {"tp2d": {"x": 2, "y": 2}, "tp": 2}}, "parallel.tp = 2 with tp2d: 2D tensor parallel replaces 1D"),
    ({"parallel": {"tp2d": {"x": 2, "y": 0}}}, "parallel.tp2d.y = 0: expected an integer >= 1"),
    ({"parallel": {"tp2d": {"x": 2, "y": 2, "scheme": "2.5d"}}}, "parallel.tp2d.scheme = '2.5d': expected one of"),
    ({"parallel": {"tp2d": {"x": 2, "y": 4}}, "per_device_train_batch_size": 6},
     "per_device_train_batch_size = 6: parallel.tp2d (2d on x=2, y=4) splits each rank's 6 rows over its axes; "
     "expected a multiple of 4"),
    ({"parallel": {"tp2d": {"x": 2, "y": 2}}, "nproc_per_node": 6},
     "nproc_per_node = 6 (x nnodes = 1): 6 ranks do not split into groups of cp * tp2d's x * y * z = 4"),
    ({"parallel": {"offload": "host"}}, "parallel.offload = 'host': the host tier (pinned memory and a copy stream on an accelerator) is not available yet; use offload: disk"),
    ({"parallel": {"offload": "disk", "recompute": True}}, "parallel.offload = 'disk': offload and recompute both cut saved activations; choose one"),
    ({"parallel": {"offload": {"budget": 0.5, "tiers": ["device", "disk"], "when": 1}}}, "unknown key 'when'"),
    ({"parallel": {"offload": {"tiers": ["disk"]}}}, "parallel.offload.tiers = ['disk']: expected [device, T]"),
    ({"parallel": {"offload": "disk", "offload_budget": 0}}, "parallel.offload_budget = 0: expected a fraction of the step's recorded peak memory, in (0, 1]"),
    ({"parallel": {"offload_budget": 0.3}}, "offload_budget = 0.3: only offload has a budget"),
    ({"disable_gradient_checkpointing": True, "parallel": {"activation_mode": "recompute"}},
     "disable_gradient_checkpointing = True conflicts with the parallel settings, which ask for recompute"),
    ({"torch_compile": True, "parallel": {"compile": False}}, "parallel.compile = False conflicts with torch_compile = True"),
    ({"parallel": {"compile": "yes"}}, "parallel.compile = 'yes': expected true or false"),
    ({"parallel": {"pp": 2, "pp_schedule": "zigzag"}}, "parallel.pp_schedule = 'zigzag': expected one of"),
    ({"parallel": {"pp": 2, "pp_microbatches": 3}, "per_device_train_batch_size": 4},
     "parallel.pp_microbatches = 3: a step's batch of per_device_train_batch_size * dp = 4 * 1 = 4 rows"),
    ({"parallel": {"pp": 2, "pp_schedule": "ZBVZeroBubble"}}, "runs 2 stages per rank; hp train runs one stage per rank"),
    ({"parallel": {"pp": 2}, "stage": "dpo", "dataset": "dpo_en_demo"}, "hp train pipelines the pt and sft stages"),
    ({"parallel": {"pp": 2, "tp": 2}, "nproc_per_node": 6},
     "nproc_per_node = 6 (x nnodes = 1): 6 ranks do not split into groups of pp * cp * tp = 4"),
    # LlamaFactory's HyperParallel keys
    ({"hyper_parallel_args": {"tp_size": 2}}, "hyper_parallel_args = {'tp_size': 2} is given but use_hyper_parallel is not true"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": 4}, "hyper_parallel_args = 4: expected a mapping of tp_size"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"ep_size": 8}},
     "hyper_parallel_args.ep_size = 8 does not divide dp = 1: expert parallel splits the data-parallel ranks"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"ep_size": 2, "token_dispatcher": "deredundency"},
      "nproc_per_node": 2},
     "hyper_parallel_args.token_dispatcher = 'deredundency': expected one of 'all_to_all'"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"activation_swap_inputs": "yes"}},
     "hyper_parallel_args.activation_swap_inputs = 'yes': expected true or false"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"activation_mode": "full"}},
     "hyper_parallel_args.activation_mode = 'full': expected one of 'none', 'recompute', 'swap'"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"fsdp_size": 3, "cp_size": 2}},
     "hyper_parallel_args.fsdp_size = 3: expected a multiple of cp = 2 (FSDP shards over the dp * cp ranks)"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"fsdp_size": 2}, "nproc_per_node": 4},
     "hyper_parallel_args.fsdp_size = 2 with 4 ranks and tp = 1: FSDP over part of the ranks with replicas across "
     "the rest (HSDP) is not available yet; expected fsdp_size = 4"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"efsdp_size": 2}},
     "hyper_parallel_args.efsdp_size = 2: FSDP has no ranks to shard over (dp * cp = 1), so hp keeps each rank's "
     "experts whole; expected efsdp_size = 1"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"ep_size": 2, "efsdp_size": 4}, "nproc_per_node": 4},
     "hyper_parallel_args.efsdp_size = 4: hp's FSDP shards each expert over the ranks that hold the same experts, "
     "dp / ep * cp = 4 / 2 * 1 = 2"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"param_dtype": "int8"}},
     "hyper_parallel_args.param_dtype = 'int8': expected one of 'float32', 'bfloat16', 'float16', 'fp32'"),
    ({"hyper_parallel_cp_size": 2}, "hyper_parallel_cp_size = 2 is given but use_hyper_parallel is not true"),
    ({"use_hyper_parallel": True, "parallel": {"fsdp": False}, "nproc_per_node": 2},
     "parallel.fsdp = False conflicts with use_hyper_parallel = True (fsdp_size unset"),
    ({"parallel": {"tp": 2}, "nproc_per_node": 3},
     "nproc_per_node = 3 (x nnodes = 1): 3 ranks do not split into groups of cp * tp = 2"),
    ({"report_to": "wandbb"}, "report_to = 'wandbb': 'wandbb' is not a tracker HF Trainer knows"),
    ({"report_to": {"tensorboard": 1}}, "expected a tracker's name, a list of them, 'none' or 'all'"),
    ({"dataloader_num_workers": -1}, "dataloader_num_workers = -1: expected an integer >= 0"),
    # DeepSpeed and HF Trainer's fsdp keys
    ({"deepspeed": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}},
     "deepspeed: zero_optimization.offload_param = {'device': 'cpu'}: offloading to the CPU or NVMe is not available"),
    ({"deepspeed": {"zero_optimization": {"stage": 4}}}, "deepspeed: zero_optimization.stage = 4: expected 0, 1, 2 or 3"),
    ({"deepspeed": {"optimizer": {"type": "Adam"}, "scheduler": {}}},
     "deepspeed: optimizer, scheduler have no counterpart in hp train"),
    ({"deepspeed": {"train_batch_size": 64}}, "deepspeed: train_batch_size = 64: expected 'auto'"),
    ({"deepspeed": {"train_micro_batch_size_per_gpu": 4}},
     "deepspeed: sets per_device_train_batch_size to 4, but the config has per_device_train_batch_size = 1"),
    ({"deepspeed": {"fp16": {"enabled": True}}}, "deepspeed: fp16.enabled = True: only bf16 mixed precision"),
    ({"deepspeed": "nope/ds.json"}, "deepspeed = 'nope/ds.json': expected the path of a JSON file"),
    ({"deepspeed": {}, "fsdp": "full_shard"}, "both pick how the model is sharded; expected one of them"),
    ({"fsdp": "hybrid_shard auto_wrap"}, "fsdp = 'hybrid_shard auto_wrap': hybrid sharding"),
    ({"fsdp": "full_shard offload"}, "fsdp = 'full_shard offload': offloading parameters to the CPU is not available"),
    ({"fsdp": "full_sharded"}, "'full_sharded' is not one of HF Trainer's fsdp options"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_offload_params": True}},
     "fsdp_config: fsdp_offload_params = True: offloading parameters to the CPU is not available yet"),
    ({"fsdp": "full_shard", "fsdp_config": {"use_xyz": 1}}, "fsdp_config: use_xyz = 1 has no counterpart in hp train"),
    ({"fsdp": "full_shard", "fsdp_config": {"activation_checkpointing": True}, "disable_gradient_checkpointing": True},
     "disable_gradient_checkpointing = True conflicts with the parallel settings"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"tp_size": 4}, "parallel": {"tp": 2}},
     "parallel.tp = 2 conflicts with hyper_parallel_args.tp_size = 4"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"fsdp_size": 4}, "parallel": {"dp": 2}},
     "parallel.dp = 2 conflicts with hyper_parallel_args.fsdp_size = 4 (which sets dp = 4)"),
    ({"use_hyper_parallel": True, "hyper_parallel_args": {"fsdp_size": 4}, "parallel": {"fsdp": False}},
     "parallel.fsdp = False conflicts with hyper_parallel_args.fsdp_size = 4 (which sets fsdp = True)"),
]


@pytest.mark.parametrize("changes, words", BAD, ids=[words.split(":")[0][:48] for _, words in BAD])
def test_bad_config(changes, words):
    raw = {key: value for key, value in {**MINIMAL, **changes}.items() if value is not None or key not in MINIMAL}
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(raw)


@pytest.mark.parametrize("text, words", [
    ("[1, 2]\n", "holds a list: expected a mapping of keys to values"),
    ("model_name_or_path: m\ndataset: d\noutput_dir: o\nbf16: true\nbf16: false\n",
     "key 'bf16' is given twice (line 4 and line 5)"),
    ("model_name_or_path: m\nparallel:\n  tp: 2\n  tp: 4\n", "key 'tp' is given twice (line 3 and line 4)"),
    ("model_name_or_path: [m\n", "is not valid YAML"),
    ("", "missing required key 'model_name_or_path'"),
])
def test_bad_files(tmp_path, text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(_write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("does not exist: expected the path of a YAML file")):
        load_config(tmp_path / "none.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_the_config_and_its_strategy_import_no_torch():
    """Checked before any worker starts: these modules do no tensor or distributed work."""
    import hp.parallel.field_error
    import hp.parallel.finetune
    import hp.parallel.placement
    import hp.parallel.strategy
    import hp.parallel.tp2d

    package = sorted(Path(config_module.__file__).parent.glob("*.py"))  # every module of hp.train.config
    own = {"hp.train.config", *(f"hp.train.config.{path.stem}" for path in package)}
    # tp2d's layouts and planner are imported when a model is laid out, not with the value
    allowed = {"hp.parallel.strategy", "hp.parallel.finetune", "hp.parallel.tp2d", "hp.parallel.tp_plan", "hp.layouts",
               "hp.parallel.placement", "hp.parallel.field_error", *own}
    modules = (hp.parallel.strategy, hp.parallel.finetune, hp.parallel.tp2d, hp.parallel.placement,
               hp.parallel.field_error)
    for path in (*package, *(Path(m.__file__) for m in modules)):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name for name in imported if name.split(".")[0] == "torch"}, (path.name, imported)
        assert {name for name in imported if name.split(".")[0] == "hp"} <= allowed, (path.name, imported)


def test_train_config_fields_match_to_dict():
    # parallel_auto is written as the YAML writes it: parallel: auto
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("no_effect", "notes", "parallel_auto")]
    assert list(to_dict(validate(MINIMAL))) == fields
    auto = validate({**MINIMAL, "parallel": "auto", "nproc_per_node": 2})
    assert to_dict(auto)["parallel"] == "auto" and validate(to_dict(auto)) == auto


def test_llamafactory_keys_without_effect_are_kept_and_round_trip():
    raw = {**MINIMAL, "report_to": "none", "preprocessing_num_workers": 16, "dataloader_num_workers": 4,
           "overwrite_cache": True, "ddp_timeout": 180000000, "save_only_model": False}
    cfg = validate(raw)
    assert dict(cfg.no_effect) == {"overwrite_cache": True}
    assert cfg.report_to == () and cfg.preprocessing_num_workers == 16 and cfg.dataloader_num_workers == 4
    assert cfg.ddp_timeout == 180000000 and validate(to_dict(cfg)) == cfg


def test_every_problem_of_a_config_is_listed_at_once():
    raw = {**MINIMAL, "learnig_rate": 1e-4, "bf16": "yes", "use_dora": True, "pref_bco_weight": 0.5,
           "parallel": {"tpp": 2}}
    with pytest.raises(ConfigError) as err:
        validate(raw)
    lines = str(err.value).splitlines()
    assert lines[0] == "5 problems in the config:"
    assert lines[1:] == [
        "  - unknown key 'learnig_rate' = 0.0001; did you mean 'learning_rate'?",
        ("  - use_dora = True is not taken by hp train (LoRA's variants (DoRA, PiSSA, LoRA+), OFT and loading or "
         "stacking trained adapters are not available yet: finetuning_type lora trains new plain LoRA adapters); "
         "expected no use_dora key, or a value that changes nothing here: false"),
        ("  - pref_bco_weight = 0.5 is not taken by hp train (PPO, BCO, LD-DPO, a reward model read while training, "
         "and reference adapters are not available yet: the preference stages are rm, dpo (pref_loss sigmoid, hinge, "
         "ipo, simpo, orpo) and kto); expected no pref_bco_weight key, or a value that changes nothing here: 0.0"),
        "  - bf16 = 'yes': expected true or false",
        "  - unknown key 'parallel.tpp' = 2; did you mean 'parallel.tp'?",
    ]


@pytest.mark.parametrize("key", ["pref_bco_weight", "galore_rank"])
def test_a_suggestion_only_for_a_likely_typo(key):
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, key: 1})
    assert "did you mean" not in str(err.value)


def test_every_example_config_validates():
    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
    assert len(examples) >= 2
    for path in examples:
        config = load_config(path)
        assert config.world_size == config.parallel.world_size, path


@pytest.mark.parametrize("mpmd", [{"place": {"vision": "pp"}}, {"place": {"vision": "pp"}, "zero_bubble": True}])
def test_a_placement_is_written_as_the_yaml_writes_it_and_read_back(mpmd):
    cfg = validate({**MINIMAL, "parallel": {"pp": 2, "mpmd": mpmd}, "disable_gradient_checkpointing": True})
    assert cfg.parallel.mpmd_place.as_dict() == {"vision": "pp"} and to_dict(cfg)["parallel"]["mpmd"] == mpmd
    assert cfg.parallel.mpmd_zero_bubble == ("zero_bubble" in mpmd)
    assert validate(to_dict(cfg)) == cfg

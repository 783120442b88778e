"""`hp train` with LoRA and freeze: adapters that train, export in PEFT's format, merge, and frozen weights that stay.

LoRA targets that name no layer are refused before any worker starts among the other bad inputs
(tests/test_failures.py, "lora targets naming nothing")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rank_pool
import torch
from train_runs import ROOT, hp_train, losses, summary

QUICKSTART_LORA = str(ROOT / "examples" / "quickstart_lora.yaml")
LORA_RUN = ["max_steps=20", "save_steps=10", "logging_steps=1"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """The LoRA quickstart (tp=2; adapters, embedding and head train), 20 steps, saved at 10 and 20."""
    out = tmp_path_factory.mktemp("lora")
    result = summary(hp_train(*LORA_RUN, f"output_dir={out}", config=QUICKSTART_LORA))
    assert result["steps"] == 20 and result["last_loss"] < 0.9 * result["first_loss"], result
    return out


def _export(checkpoint: Path, out: Path, *flags: str) -> None:
    run = rank_pool.python("-m", "hp.cli", "export", str(checkpoint), str(out), *flags, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def _hp_model(checkpoint: Path):
    """The checkpoint's model as hp trained it: base weights and adapters, unmerged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp.parallel.lora import add_lora, from_peft_config
    from hp.train.checkpoint import load_model_weights

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    add_lora(model, from_peft_config(json.loads((checkpoint / "adapter_config.json").read_text())))
    load_model_weights(str(checkpoint), model)
    return model


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_lora_adapter_exported_by_hp_loads_in_peft_with_hp_s_logits(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = lora_run / "checkpoint-20"
    _export(checkpoint, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    mine = _hp_model(checkpoint)
    assert any(m.lora_B.weight.abs().max() > 0 for m in mine.modules() if hasattr(m, "lora_B"))  # they trained
    torch.manual_seed(42)  # the run's seed: hp/tiny-llama's base weights, which LoRA leaves as they were
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    theirs = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert (_logits(theirs) - _logits(mine)).abs().max().item() <= 1e-5


def test_merge_writes_a_plain_hf_model_with_the_same_logits(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = lora_run / "checkpoint-20"
    _export(checkpoint, tmp_path / "merged", "--merge")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert (_logits(merged) - _logits(_hp_model(checkpoint))).abs().max().item() <= 1e-5


def test_a_lora_checkpoint_resumes_under_fsdp_with_the_same_losses(lora_run, tmp_path):
    """Adapters, their optimizer state and the frozen weights reshard from tp=2 to FSDP over dp=2."""
    resumed = summary(hp_train(*LORA_RUN, "parallel.tp=1", "parallel.dp=2", "parallel.fsdp=true",
                               "per_device_train_batch_size=16",  # the same 32 examples a step over dp=2
                               f"output_dir={tmp_path}", f"resume_from_checkpoint={lora_run / 'checkpoint-10'}",
                               config=QUICKSTART_LORA))
    assert resumed["steps_this_run"] == 10
    want, got = losses(lora_run), losses(tmp_path)
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_freeze_trains_only_the_last_layers(tmp_path):
    """freeze_trainable_layers=1 with mlp: the first layer and every attention keep their weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp.train.checkpoint import load_model_weights

    out = tmp_path / "freeze"
    summary(hp_train("finetuning_type=freeze", "freeze_trainable_layers=1", "freeze_trainable_modules=mlp",
                     "freeze_extra_modules=norm", "max_steps=2", "save_steps=2", f"output_dir={out}"))
    config = AutoConfig.from_pretrained(out / "checkpoint-2")
    trained = AutoModelForCausalLM.from_config(config)
    load_model_weights(str(out / "checkpoint-2"), trained)
    torch.manual_seed(42)
    start = AutoModelForCausalLM.from_config(config)
    changed = {n for (n, a), b in zip(trained.named_parameters(), start.parameters()) if not torch.equal(a, b)}
    last = config.num_hidden_layers - 1
    assert changed == {f"model.layers.{last}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {"model.norm.weight"}


@pytest.mark.parametrize("freeze, message", [
    (dict(trainable_layers=3), "freeze_trainable_layers = 3: LlamaForCausalLM has 2 decoder layers"),
    (dict(trainable_modules=("attn",)), r"freeze_trainable_modules \['attn'\] name no module of LlamaDecoderLayer"),
    (dict(extra_modules=("head",)), "freeze_extra_modules names 'head', which is no module outside the decoder"),
])
def test_freeze_names_that_match_nothing_are_refused_and_change_nothing(freeze, message):
    from reference import tiny_pair

    from hp.train.finetuning import Finetuning, Freeze, FreezeError, apply_finetuning

    _, model = tiny_pair("llama")
    with pytest.raises(FreezeError, match=message):
        apply_finetuning(model, Finetuning(freeze=Freeze(**freeze)), "model.layers")
    assert all(p.requires_grad for p in model.parameters())

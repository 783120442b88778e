"""`hp train` on models and launches: every zoo family, every strategy, and what is refused.

Every run is a real `hp train` subprocess, or one launch of its training loop
for all families (bad input is tests/test_failures.py's).
"""

from __future__ import annotations

import json

import pytest
from train_runs import DATA, first_batch, hp_train, local_hf_model, losses, run_cases, summary

from hp.models import FAMILIES


# The zoo's hand-checked families and some whose plans are derived from transformers' own (Mixtral's and
# DeepSeek-V3's experts stored one by one under their own names, read into the packed weights).
TRAINED = (*FAMILIES, "olmo2", "granite", "smollm3", "glm4", "starcoder2", "cohere", "gpt_neox", "mixtral",
           "deepseek_v3", "gpt_oss")


def test_a_local_hf_model_directory_of_every_family_trains(tmp_path):
    """hp's trainer on each family's local directory at tp=2, in one launch: HF's first loss."""
    from transformers import AutoModelForCausalLM

    for family in TRAINED:
        local_hf_model(tmp_path / family, family)
    # 64 records: one step draws 8 of them, and every rank tokenizes what it reads for each of the 18 families
    cases = {family: [f"model_name_or_path={tmp_path / family}", "max_steps=1", "save_steps=1000", "max_samples=64",
                      "per_device_train_batch_size=8", "parallel.tp=2", f"dataset_dir={DATA}"] for family in TRAINED}
    first = {family: got for family, (_, got, _) in run_cases(tmp_path / "out", 2, cases, logits=False).items()}
    for family in TRAINED:
        ids, labels = first_batch([f"model_name_or_path={tmp_path / family}", "per_device_train_batch_size=8",
                                   "max_samples=64"])
        model = AutoModelForCausalLM.from_pretrained(tmp_path / family)
        want = model(input_ids=ids, labels=labels).loss.item()
        assert first[family] == pytest.approx(want, rel=1e-5), family


def test_data_parallel_from_a_local_directory_follows_one_device_step_by_step(tmp_path):
    """dp alone runs plain parameters (each rank its rows, gradients summed during backward) on weights loaded
    into a model first laid out on the meta device: four steps of two micro-batches give one device's losses,
    and the step's sums are counted on the dp axis."""
    local_hf_model(tmp_path / "model", "qwen3")
    common = [f"model_name_or_path={tmp_path / 'model'}", "max_steps=4", "logging_steps=1", "save_steps=4",
              "gradient_accumulation_steps=2", "parallel.tp=1", "disable_gradient_checkpointing=false"]
    one = summary(hp_train(*common, "per_device_train_batch_size=8", f"output_dir={tmp_path / 'one'}"))
    two = summary(hp_train(*common, "parallel.dp=2", "per_device_train_batch_size=4", f"output_dir={tmp_path / 'two'}"))
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert got == pytest.approx(want, rel=1e-5) and len(got) == 4
    assert two["comm_bytes_per_step"]["dp"] > 0 and not one["comm_bytes_per_step"]


def test_hp_train_loads_a_fused_family_rank_by_rank(tmp_path):
    """The command itself (preflight, launcher, workers) on Phi-3, whose fused weights load through a stand-in."""
    from transformers import AutoModelForCausalLM

    local_hf_model(tmp_path / "model", "phi3")
    overrides = [f"model_name_or_path={tmp_path / 'model'}", "max_steps=1", "per_device_train_batch_size=8",
                 f"output_dir={tmp_path / 'out'}", f"dataset_dir={DATA}"]
    result = summary(hp_train(*overrides))  # tp=2: each rank reads its halves of the weights
    ids, labels = first_batch(overrides)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "model")(input_ids=ids, labels=labels).loss.item()
    assert result["first_loss"] == pytest.approx(want, rel=1e-5)
    assert result["comm_bytes_per_step"]["tp"] > 0


def test_compiled_blocks_train_as_eager_ones(tmp_path):
    """LlamaFactory's torch_compile on its everyday config, data parallel with recompute: the losses of
    eager blocks, step by step (the first step runs eagerly under the byte trace, the others compiled,
    each block's graph run again in backward). tp, sp, cp and FSDP compile in tests/workers/compile_gloo.py."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["torch_compile=true"])):
        out = tmp_path / name
        # both on the zygote's fresh forks: inductor there compiles as in a fresh process, 13 s sooner (cold cache)
        summary(hp_train("parallel.tp=1", "parallel.dp=2", "disable_gradient_checkpointing=false", "max_steps=3",
                         "logging_steps=1", "per_device_train_batch_size=4", f"output_dir={out}", *extra))
        runs[name] = losses(out)
        assert json.loads((out / "hp_config.json").read_text())["parallel"]["recompute"], name
    assert runs["compiled"].keys() == runs["eager"].keys() == {1, 2, 3}
    for step, want in runs["eager"].items():
        assert runs["compiled"][step] == pytest.approx(want, rel=1e-5), step


@pytest.mark.parametrize(
    "strategy, axis",
    [
        (["parallel.tp=1", "parallel.dp=2", "parallel.fsdp=true"], "dp"),
        (["parallel.tp=1", "parallel.cp=2", "parallel.cp_algorithm=ring", "disable_gradient_checkpointing=false"], "cp"),
        (["parallel.sp=true"], "tp"),
        (["parallel.dp=2", "parallel.fsdp=true", "parallel.sp=true", "disable_gradient_checkpointing=false"], "tp"),
    ],
)
def test_every_strategy_of_the_zoo_trains_through_hp_train(tmp_path, strategy, axis):
    """Same first loss as one device would give (the global batch is the same), bytes on the right axis.

    Two cases recompute activations (LlamaFactory's default, which the quickstart turns off).
    """
    import torch
    from transformers import LlamaForCausalLM

    from hp.train.data import ByteTokenizer
    from hp.train.data.embedded import tiny_llama_config

    overrides = [*strategy, "max_steps=1", "per_device_train_batch_size=4", f"output_dir={tmp_path}",
                 f"dataset_dir={DATA}"]
    result = summary(hp_train(*overrides))
    ids, labels = first_batch(overrides)
    torch.manual_seed(42)  # the quickstart's seed: the embedded model's initial weights
    want = LlamaForCausalLM(tiny_llama_config(ByteTokenizer().vocab_size))(input_ids=ids, labels=labels).loss.item()
    assert result["first_loss"] == pytest.approx(want, rel=1e-5)
    assert result["comm_bytes_per_step"][axis] > 0

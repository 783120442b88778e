"""`hp train` end to end: the quickstart learns, kill-and-resume, resume under another strategy, export, bad configs.

Every run is a real `hp train` subprocess (torch's elastic launcher and gloo
workers when the strategy has more than one rank), on the embedded tiny
Llama and the quickstart data; the steps are few and the model is small.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gloo_launch import _free_port, clean_env

from hp.models import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
# six optimizer steps of 4 accumulated micro-batches: long enough to kill a run between two saves
SHORT = ["max_steps=6", "save_steps=3", "logging_steps=1", "gradient_accumulation_steps=4",
         "per_device_train_batch_size=8", "lr_scheduler_type=linear", "warmup_ratio=0.2"]


def hp_train(*overrides: str, config: str = QUICKSTART, wait: bool = True):
    command = [sys.executable, "-m", "hp.cli", "train", config, f"dataset_dir={ROOT / 'examples' / 'data'}",
               f"master_port={_free_port()}", *overrides]
    if not wait:
        return subprocess.Popen(command, env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)


def summary(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def losses(output_dir: Path) -> dict[int, float]:
    with open(output_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def first_batch(overrides: list[str]):
    """The global batch the first step of `hp train QUICKSTART *overrides` draws, computed here."""
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples
    from hp.train.tokenizer import load_tokenizer

    config = load_config(QUICKSTART, overrides)
    tokenizer = load_tokenizer(config.model_name_or_path)
    batch = config.per_device_train_batch_size * config.parallel.dp
    return next(TokenBatches(load_examples(config, tokenizer), batch, config.seed, tokenizer.pad_token_id))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Six steps at tp=2 without interruption: the reference sequence of losses."""
    out = tmp_path_factory.mktemp("uninterrupted")
    summary(hp_train(*SHORT, f"output_dir={out}"))
    return out


def test_quickstart_loss_falls(tmp_path):
    result = summary(hp_train("max_steps=40", "save_steps=40", f"output_dir={tmp_path}"))
    assert {"first_loss", "last_loss", "steps", "tokens_per_s"} <= result.keys()
    assert result["steps"] == 40 and result["tokens_per_s"] > 0
    assert result["last_loss"] < 0.6 * result["first_loss"], result
    assert result["comm_bytes_per_step"]["tp"] > 0
    assert (tmp_path / "checkpoint-40" / "trainer_state.pt").is_file()
    assert len(losses(tmp_path)) >= 4


def test_killed_run_resumes_with_the_same_losses(uninterrupted, tmp_path):
    run = hp_train(*SHORT, f"output_dir={tmp_path}", wait=False)
    deadline = time.time() + 300
    while not (tmp_path / "checkpoint-3").is_dir():  # renamed into place only when complete
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # the launcher and both workers, mid-run
    run.wait()
    assert not (tmp_path / "checkpoint-6").exists(), "the kill came too late to interrupt the run"
    summary(hp_train(*SHORT, f"output_dir={tmp_path}", "resume_from_checkpoint=last"))
    want, got = losses(uninterrupted), losses(tmp_path)
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]


@pytest.mark.parametrize("strategy", [["parallel.tp=1"], ["parallel.tp=1", "parallel.dp=2", "per_device_train_batch_size=4"]])
def test_checkpoint_resumes_under_another_strategy(uninterrupted, tmp_path, strategy):
    resumed = summary(hp_train(*SHORT, *strategy, f"output_dir={tmp_path}",
                               f"resume_from_checkpoint={uninterrupted / 'checkpoint-3'}"))
    assert resumed["steps"] == 6 and resumed["steps_this_run"] == 3
    want, got = losses(uninterrupted), losses(tmp_path)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_export_gives_hf_safetensors_with_the_same_logits(uninterrupted, tmp_path):
    checkpoint = uninterrupted / "checkpoint-6"
    export = subprocess.run([sys.executable, "-m", "hp.cli", "export", str(checkpoint), str(tmp_path / "hf")],
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    check = subprocess.run([sys.executable, str(WORKERS / "export_check.py"), str(checkpoint), str(tmp_path / "hf")],
                           env=clean_env(), capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert json.loads(check.stdout.splitlines()[-1])["max_abs_diff"] == 0.0


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_usable(uninterrupted, tmp_path):
    crash = subprocess.run([sys.executable, str(WORKERS / "save_crash.py"), str(uninterrupted), str(tmp_path)],
                           env=clean_env(), capture_output=True, text=True, timeout=300)
    assert crash.returncode == 0, crash.stderr[-3000:]
    assert json.loads(crash.stdout.splitlines()[-1]) == {"latest": "checkpoint-6", "partial_left": True}


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tp=3", "parallel.tp = 3 does not divide num_attention_heads = 4 of the model"),
        ("parallel.cp=4", "parallel.cp = 4 (Ulysses) does not divide the 2 heads per tp rank"),
        ("learning_rate=fast", "learning_rate = 'fast'"),
        ("stage=dpo", "stage = 'dpo'"),
        ("lr=1e-4", "lr"),
        ("resume_from_checkpoint=/nonexistent/checkpoint-3",
         "resume_from_checkpoint = '/nonexistent/checkpoint-3': /nonexistent/checkpoint-3 is not a complete hp checkpoint"),
    ],
)
def test_bad_configs_fail_before_any_worker_starts(tmp_path, override, message):
    run = hp_train(override, f"output_dir={tmp_path / 'out'}")
    assert run.returncode == 2
    assert message in run.stderr and "torch.distributed" not in run.stderr
    assert not (tmp_path / "out").exists()


def local_hf_model(directory: Path, family: str = "llama") -> None:
    """A tiny model of `family` saved as a HF directory: config, safetensors and a locally trained BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hp.models import tiny_config

    records = json.loads((ROOT / "examples" / "data" / "quickstart.json").read_text())
    text = [" ".join(r.values()) for r in records[:200]]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(3)
    config = tiny_config(family, layers=2, vocab_size=320, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


# Two workers where the family adds something to load (fused weights, a tied head, computed buffers);
# one in-process rank for the families whose modules are Llama's.
TWO_RANKS = ("llama", "phi3", "gemma2", "gemma3_text")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_local_hf_model_directory_of_every_family_trains(tmp_path, family):
    from transformers import AutoModelForCausalLM

    local_hf_model(tmp_path / "model", family)
    tp = 2 if family in TWO_RANKS else 1
    overrides = [f"model_name_or_path={tmp_path / 'model'}", "max_steps=1", "per_device_train_batch_size=8",
                 f"parallel.tp={tp}", f"output_dir={tmp_path / 'out'}", f"dataset_dir={ROOT / 'examples' / 'data'}"]
    result = summary(hp_train(*overrides))  # tp=2: each rank reads its halves of the weights
    ids, labels = first_batch(overrides)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "model")(input_ids=ids, labels=labels).loss.item()
    assert result["first_loss"] == pytest.approx(want, rel=1e-5)
    assert (tp == 1) or result["comm_bytes_per_step"]["tp"] > 0


def test_a_model_type_without_a_plan_is_refused_before_any_worker_starts(tmp_path):
    from transformers import GPT2Config

    local_hf_model(tmp_path / "model")
    GPT2Config(n_embd=64, n_layer=1, n_head=4).save_pretrained(tmp_path / "model")  # its config.json now says gpt2
    run = hp_train(f"model_name_or_path={tmp_path / 'model'}", f"output_dir={tmp_path / 'out'}")
    assert run.returncode == 2
    assert "no model plan for model_type 'gpt2'; hp.models has plans for llama, mistral, qwen2, qwen3, gemma2" in run.stderr
    assert "torch.distributed" not in run.stderr and not (tmp_path / "out").exists()


def test_a_device_this_machine_lacks_is_refused(tmp_path):
    from hp.device import available

    missing = next(d for d in ("cuda", "npu") if d != available())
    run = hp_train(f"device={missing}", f"output_dir={tmp_path / 'out'}")
    assert run.returncode == 2
    assert f"device = '{missing}' is not available on this machine" in run.stderr


def test_an_existing_run_is_neither_appended_to_nor_overwritten_unasked(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    run = hp_train(f"output_dir={tmp_path}", "overwrite_output_dir=false")
    assert run.returncode == 2
    assert f"output_dir = '{tmp_path}' already holds a run; set overwrite_output_dir: true" in run.stderr
    assert (tmp_path / "checkpoint-3").is_dir()


def test_two_nodes_join_one_rendezvous(tmp_path):
    """Two `hp train` launchers, node_rank 0 and 1 of nnodes=2, one worker each, form one tp=2 run."""
    port = _free_port()
    common = ["max_steps=3", "save_steps=3", f"output_dir={tmp_path}", "nnodes=2", "nproc_per_node=1",
              f"master_port={port}"]
    nodes = [hp_train(*common, f"node_rank={rank}", wait=False) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    result = json.loads(outputs[0][0].strip().splitlines()[-1])  # global rank 0 lives on node 0
    assert result["steps"] == 3 and result["comm_bytes_per_step"]["tp"] > 0
    assert (tmp_path / "checkpoint-3" / "trainer_state.pt").is_file()


@pytest.mark.parametrize(
    "strategy, axis",
    [
        (["parallel.tp=1", "parallel.dp=2", "parallel.fsdp=true"], "dp"),
        (["parallel.tp=1", "parallel.cp=2", "parallel.cp_algorithm=ring"], "cp"),
        (["parallel.sp=true"], "tp"),
        (["parallel.dp=2", "parallel.fsdp=true", "parallel.sp=true"], "tp"),
    ],
)
def test_every_strategy_of_the_zoo_trains_through_hp_train(tmp_path, strategy, axis):
    """Same first loss as one device would give (the global batch is the same), bytes on the right axis."""
    import torch
    from transformers import LlamaForCausalLM

    from hp.train.model import tiny_llama_config
    from hp.train.tokenizer import ByteTokenizer

    overrides = [*strategy, "max_steps=1", "per_device_train_batch_size=4", f"output_dir={tmp_path}",
                 f"dataset_dir={ROOT / 'examples' / 'data'}"]
    result = summary(hp_train(*overrides))
    ids, labels = first_batch(overrides)
    torch.manual_seed(42)  # the quickstart's seed: the embedded model's initial weights
    want = LlamaForCausalLM(tiny_llama_config(ByteTokenizer().vocab_size))(input_ids=ids, labels=labels).loss.item()
    assert result["first_loss"] == pytest.approx(want, rel=1e-5)
    assert result["comm_bytes_per_step"][axis] > 0

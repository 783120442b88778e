"""`hp train` end to end on the quickstart: the loss falls, kill-and-resume, resume under another strategy, export.

Every run is a real `hp train` subprocess (torch's elastic launcher and gloo
workers when the strategy has more than one rank), on the embedded tiny
Llama and the quickstart data; the steps are few and the model is small.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import rank_pool
import torch
from gloo_launch import _free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from train_runs import (DATA, QUICKSTART, WORKERS, assert_stopped_whole, first_batch, hp_train, launch,
                        local_hf_model, losses, ranks, summary, worker_of_rank, workers)

# six optimizer steps of 4 accumulated micro-batches: long enough to kill a run between two saves
SHORT = ["max_steps=6", "save_steps=3", "logging_steps=1", "gradient_accumulation_steps=4",
         "per_device_train_batch_size=8", "lr_scheduler_type=linear", "warmup_ratio=0.2"]


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
    """SIGKILL to the launcher mid-run (what the out-of-memory killer or a scheduler sends): its workers die with
    it, every checkpoint left is whole, and the run resumes with the uninterrupted losses."""
    run = hp_train(*SHORT, f"output_dir={tmp_path}", "report_to=tensorboard", wait=False)
    deadline = time.time() + 300
    while not (tmp_path / "checkpoint-3").is_dir():  # renamed into place only when complete
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    # the launcher, its zygote, two workers and their stand-ins, found by their command lines
    assert len(workers(str(tmp_path))) == 6 and set(ranks(str(tmp_path))) == {0, 1}
    run.send_signal(signal.SIGKILL)  # the launcher alone: the kernel ends the rest (hp.train.worker.die_with)
    run.wait()
    assert_stopped_whole(tmp_path, "SIGKILL")
    assert not (tmp_path / "checkpoint-6").exists(), "the kill came too late to interrupt the run"
    # collated ahead by two loader processes: the same batches, so the same losses
    summary(hp_train(*SHORT, f"output_dir={tmp_path}", "resume_from_checkpoint=last", "report_to=tensorboard",
                     "dataloader_num_workers=2"))
    want, got = losses(uninterrupted), losses(tmp_path)
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # the steps logged after checkpoint-3 and before the kill are not repeated
    # TensorBoard holds the same losses, each step once (what the killed run wrote past step 3 is purged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(got)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_an_offloaded_run_has_the_same_losses_and_checkpoints(uninterrupted, tmp_path):
    result = summary(hp_train(*SHORT, "parallel.offload=disk", "parallel.offload_budget=0.5", f"output_dir={tmp_path}"))
    assert losses(tmp_path) == losses(uninterrupted)  # bit for bit: the same bytes come back
    assert result["offload_bytes_per_step"] > 0
    # AdamW's states waited in the disk tier between updates; the checkpoint holds them all the same
    assert _optimizer_states(tmp_path / "checkpoint-3") == _optimizer_states(uninterrupted / "checkpoint-3")


def _optimizer_states(saved: Path) -> list:
    """Every value of a DCP checkpoint's optimizer state, tensors as lists, in a fixed order."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.utils._pytree import tree_flatten_with_path

    flat = saved.parent / f"{saved.name}.pt"
    dcp_to_torch_save(str(saved), str(flat))
    leaves, _ = tree_flatten_with_path(torch.load(flat)["optim"])
    return [(path, v.tolist() if isinstance(v, torch.Tensor) else v) for path, v in leaves]


@pytest.mark.parametrize("strategy", [["parallel.tp=1"], ["parallel.tp=1", "parallel.dp=2", "per_device_train_batch_size=4"],
                                      ["parallel.tp=1", "parallel.pp=2"], ["parallel.tp=1", "parallel.tp2d={x: 2, y: 2}"]])
def test_checkpoint_resumes_under_another_strategy(uninterrupted, tmp_path, strategy):
    resumed = summary(hp_train(*SHORT, *strategy, f"output_dir={tmp_path}",
                               f"resume_from_checkpoint={uninterrupted / 'checkpoint-3'}"))
    assert resumed["steps"] == 6 and resumed["steps_this_run"] == 3
    want, got = losses(uninterrupted), losses(tmp_path)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.parametrize("other, axes", [
    (["parallel.pp=2"], {"pp"}),  # 1F1B, two micro-batches of each accumulated batch; each rank half the model
    (["parallel.tp2d={x: 2, y: 2}"], {"x", "y"}),  # each weight split over x and y
], ids=["pp", "tp2d"])
def test_another_split_has_the_tp_runs_losses_and_its_checkpoint_resumes_at_tp(uninterrupted, tmp_path, other, axes):
    """pp=2, or 2D tensor parallel on 2 x 2 ranks, against tp=2: the same losses step by step, bytes on the
    split's own axes; its checkpoint, its weights and optimizer states split its way, resumes at tp=2."""
    split = tmp_path / "split"
    result = summary(hp_train(*SHORT, "parallel.tp=1", *other, f"output_dir={split}"))
    assert result["comm_bytes_per_step"].keys() == axes
    want, got = losses(uninterrupted), losses(split)
    assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)
    resumed = tmp_path / "tp"
    summary(hp_train(*SHORT, f"output_dir={resumed}", f"resume_from_checkpoint={split / 'checkpoint-3'}"))
    got = losses(resumed)
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in (4, 5, 6)), (got, want)


def test_a_local_gemma3_directory_trains_pipelined_as_at_tp(tmp_path):
    """Read from files, cut into stages: Gemma3's embedding scale (a buffer, not in the files) and its head
    tied to the embedding across the two stages; the losses are the tp=2 run's."""
    local_hf_model(tmp_path / "model", "gemma3_text")
    run = ["max_steps=3", "logging_steps=1", f"model_name_or_path={tmp_path / 'model'}"]
    summary(hp_train(*run, f"output_dir={tmp_path / 'tp'}"))
    summary(hp_train(*run, "parallel.tp=1", "parallel.pp=2", f"output_dir={tmp_path / 'pp'}"))
    want, got = losses(tmp_path / "tp"), losses(tmp_path / "pp")
    assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)


def test_a_pipelined_checkpoint_resumes_over_more_stages(tmp_path):
    """pp=2 -> pp=4 on a 4-layer model: each of the four ranks loads its block's weights and optimizer
    states from what two ranks saved; the losses after the switch are the uninterrupted run's."""
    local_hf_model(tmp_path / "model", "llama", layers=4)
    run = ["max_steps=4", "save_steps=2", "logging_steps=1", f"model_name_or_path={tmp_path / 'model'}",
           "parallel.tp=1"]
    summary(hp_train(*run, "parallel.pp=2", f"output_dir={tmp_path / 'two'}"))
    summary(hp_train(*run, "parallel.pp=4", f"output_dir={tmp_path / 'four'}",
                     f"resume_from_checkpoint={tmp_path / 'two' / 'checkpoint-2'}"))
    want, got = losses(tmp_path / "two"), losses(tmp_path / "four")
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in (3, 4)), (got, want)


def test_a_pipelined_run_evaluates_as_the_tp_run(tmp_path):
    evaluated = ["max_steps=2", "val_size=0.1", "eval_strategy=steps", "eval_steps=2", "logging_steps=1"]
    want = summary(hp_train(*evaluated, f"output_dir={tmp_path / 'tp'}"))["eval_loss"]
    got = summary(hp_train(*evaluated, "parallel.tp=1", "parallel.pp=2", f"output_dir={tmp_path / 'pp'}"))["eval_loss"]
    assert got == pytest.approx(want, rel=1e-5)


def test_a_checkpoint_with_the_optimizer_groups_in_one_list_still_loads(tmp_path, monkeypatch):
    """Before the optimizer's settings were keyed by parameter name, a checkpoint held them as one list."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from hp.train import checkpoint

    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        model.config = type("Config", (), {"to_json_file": lambda self, path: None})()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = trained(0)
    monkeypatch.setattr(checkpoint, "_FLAT", StateDictOptions())  # as checkpoints were written before
    path = checkpoint.save(str(tmp_path), 1, model, optimizer, {"scheduler": {}, "data": {}})
    monkeypatch.undo()
    assert not checkpoint._flat_optimizer(path)
    fresh, fresh_optimizer = trained(1)
    checkpoint.load(path, fresh, fresh_optimizer)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["exp_avg"], fresh_optimizer.state[q]["exp_avg"])


def test_export_gives_hf_safetensors_with_the_same_logits_and_hp_train_continues_from_it(uninterrupted, tmp_path):
    """The export loads in `transformers` with the run's logits, and carries the byte tokenizer as HF files."""
    from transformers import AutoModelForCausalLM

    checkpoint, hf = uninterrupted / "checkpoint-6", tmp_path / "hf"
    export = rank_pool.python("-m", "hp.cli", "export", str(checkpoint), str(hf), timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (hf / "model.safetensors").is_file()
    check = rank_pool.python(str(WORKERS / "export_check.py"), str(checkpoint), str(hf), timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert json.loads(check.stdout.splitlines()[-1])["max_abs_diff"] == 0.0
    overrides = [f"model_name_or_path={hf}", "max_steps=1", "parallel.tp=1", f"output_dir={tmp_path / 'again'}",
                 f"dataset_dir={DATA}"]
    continued = summary(hp_train(*overrides))
    ids, labels = first_batch(overrides)
    assert torch.equal(ids, first_batch([f"dataset_dir={DATA}"])[0])  # the exported tokenizer gives the same ids
    want = AutoModelForCausalLM.from_pretrained(hf)(input_ids=ids, labels=labels).loss.item()
    assert continued["first_loss"] == pytest.approx(want, rel=1e-5)


def test_the_evaluation_loss_is_the_held_out_loss_of_the_saved_weights(tmp_path):
    """val_size holds examples out; at tp=2 their loss equals HF's on the checkpoint's weights, all in one batch."""
    from transformers import LlamaForCausalLM

    from hp.train.checkpoint import load_model_weights
    from hp.train.config import load_config
    from hp.train.data import ByteTokenizer, collate, load_splits
    from hp.train.data.embedded import tiny_llama_config

    overrides = ["max_steps=2", "save_steps=2", "val_size=0.05", "eval_strategy=steps", "eval_steps=2",
                 "per_device_eval_batch_size=16", f"output_dir={tmp_path}", f"dataset_dir={DATA}"]
    result = summary(hp_train(*overrides))
    tokenizer = ByteTokenizer()
    train, held = load_splits(load_config(QUICKSTART, overrides), tokenizer)
    assert len(held) == 100 and len(train) == 1900  # 5% of the 2000 quickstart records
    model = LlamaForCausalLM(tiny_llama_config(tokenizer.vocab_size))
    load_model_weights(str(tmp_path / "checkpoint-2"), model)
    ids, labels = collate(held.examples, tokenizer.pad_token_id)
    want = model(input_ids=ids, labels=labels).loss.item()
    assert result["eval_loss"] == pytest.approx(want, rel=1e-5)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "eval_loss": result["eval_loss"], "eval_perplexity": result["eval_perplexity"]} in records


def test_a_damaged_newest_checkpoint_is_passed_over_and_the_run_resumes_from_the_one_before(uninterrupted, tmp_path):
    """checkpoint-6's trainer state cut short (as a full disk leaves it): `last` resumes from checkpoint-3 with
    the uninterrupted losses and says which one it passed over and why; named explicitly, it is refused."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    state = out / "checkpoint-6" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    run = hp_train(*SHORT, "max_steps=6", f"output_dir={out}", "resume_from_checkpoint=last")
    resumed = summary(run)
    assert resumed["steps_this_run"] == 3
    assert f"passes over {out / 'checkpoint-6'}: {state} is cut short: 100 bytes" in run.stderr
    want, got = losses(uninterrupted), losses(out)
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in (4, 5, 6)), (got, want)
    state.write_bytes(state.read_bytes()[:100])  # the resumed run wrote checkpoint-6 anew: damage it again
    refused = hp_train(*SHORT, f"output_dir={out}", f"resume_from_checkpoint={out / 'checkpoint-6'}")
    assert refused.returncode != 0 and f"checkpoint-6 is damaged: {state} is cut short" in refused.stderr


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(after=st.sampled_from([1, 2, 4, 5]), nodes=st.sampled_from([1, 2]))  # one kill a run (faults.py tries ten)
def test_a_worker_killed_mid_run_restarts_with_the_uninterrupted_losses(uninterrupted, tmp_path_factory, after, nodes):
    """max_restarts: 1 and rank 1 SIGKILLed once step `after` is logged: the group restarts from the last
    complete checkpoint (from the start before checkpoint-3), finishes with the uninterrupted run's loss at
    every step, and the summary lists the restart. On two nodes (two launchers here, one worker each, over
    the c10d rendezvous) both restart, and the node that lost its worker names it."""
    out = tmp_path_factory.mktemp("killed")
    port = f"master_port={_free_port()}"
    per_node = [f"nnodes={nodes}", f"nproc_per_node={2 // nodes}"]
    launchers = launch(*([*SHORT, "max_restarts=1", f"output_dir={out}", *per_node, f"node_rank={node}", port]
                         for node in range(nodes)))
    deadline = time.time() + 300
    while max([0, *losses(out)] if (out / "metrics.jsonl").exists() else [0]) < after:
        assert all(run.poll() is None for run in launchers) and time.time() < deadline, launchers[0].communicate()
        time.sleep(0.02)
    os.kill(worker_of_rank(str(out), 1), signal.SIGKILL)
    ended = [run.communicate(timeout=300) for run in launchers]
    assert [run.returncode for run in launchers] == [0] * nodes, [err[-3000:] for _, err in ended]
    stdout = next(out_ for out_, _ in ended if out_.strip())  # global rank 0's node prints the summary
    assert len(json.loads(stdout.strip().splitlines()[-1])["restarts"]) == 1
    stderr = "".join(err for _, err in ended)
    assert "worker rank 1 was killed by SIGKILL" in stderr
    assert stderr.count("restarting the workers from the last complete checkpoint (restart 1 of 1)") == nodes
    assert losses(out) == losses(uninterrupted)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_usable(uninterrupted, tmp_path):
    crash = rank_pool.python(str(WORKERS / "save_crash.py"), str(uninterrupted), str(tmp_path), timeout=300)
    assert crash.returncode == 0, crash.stderr[-3000:]
    assert json.loads(crash.stdout.splitlines()[-1]) == {"latest": "checkpoint-6", "partial_left": True}

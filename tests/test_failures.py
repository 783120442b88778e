"""`hp train` on bad input, divergence, signals and busy machines: one clear message, the right exit code.

Each bad input runs the `hp` command's entry point in this process (what the
launcher checks needs no worker) and must end with exit code 2 and one
message naming the key, file or record, with no traceback, in under 15 lines
of stderr, without starting a worker and without touching the checkpoints of
the run already in `output_dir` (even with `overwrite_output_dir: true`).
What only workers can meet (a diverging loss, signals, two runs at once) runs
as real `hp train` subprocesses.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import rank_pool
from train_runs import (DATA, QUICKSTART, assert_stopped_whole, hp_train, launch, local_hf_model, summary, ranks,
                        worker_of_rank, workers)

from hp.train import checkpoint, manifest

FAST = ["max_steps=2", "save_steps=1", "per_device_train_batch_size=4"]  # two checkpoints to leave alone
PWNED = "hp-test-pwned"  # a file the planted pickles would create if they ran


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real two-step run with a checkpoint per step: the existing run every bad input must leave alone."""
    out = tmp_path_factory.mktemp("finished") / "run"
    summary(hp_train(*FAST, "parallel.tp=1", f"output_dir={out}"))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("model") / "llama"
    local_hf_model(directory)
    return directory


@pytest.fixture
def run_here(capfd):
    """`hp train QUICKSTART *overrides` through the command's entry point in this process: (exit code, stderr)."""
    from hp.cli import main

    handler = signal.getsignal(signal.SIGTERM)

    def run(*overrides: str, config: str = QUICKSTART) -> tuple[int, str]:
        try:
            code = main(["train", config, f"dataset_dir={DATA}", *FAST, *overrides])
        finally:
            signal.signal(signal.SIGTERM, handler)
        return code, capfd.readouterr().err

    return run


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _lines(err: str) -> list[str]:
    """stderr's lines as a terminal shows them (a progress bar redrawn with carriage returns is one)."""
    return err.strip().split("\n")


def assert_one_message(code: int, err: str, words: str, exit_code: int = 2) -> None:
    assert code == exit_code, err
    assert words in err, err
    assert "Traceback" not in err and len(_lines(err)) < 15, err
    assert err.startswith("hp train: ") and err.count("hp train: ") == 1, err
    assert "workers on this node" not in err, "a worker started although the launcher could have known"


# ---------------------------------------------------------------- bad inputs, each a function of a scratch dir


def _data(tmp: Path, files: dict[str, str], info: dict | str | None = None) -> str:
    """A dataset_dir holding `files`, and `info` as its dataset_info.json (a string is written as is)."""
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for name, text in files.items():
        (data / name).write_text(text)
    if info is not None:
        (data / "dataset_info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    return f"dataset_dir={data}"


def _records(n: int = 40, **fields) -> str:
    return json.dumps([{"instruction": f"say {i}", "output": f"{i}", **fields} for i in range(n)])


def _model(tmp: Path, model_dir: Path, change: Callable[[Path], None]) -> str:
    copy = tmp / "model"
    shutil.copytree(model_dir, copy)
    change(copy)
    return f"model_name_or_path={copy}"


def _drop_weights(copy: Path) -> None:
    (copy / "model.safetensors").unlink()


def _pickled_weights(copy: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(copy / "model.safetensors"), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()


def _edit_weights(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def change(copy: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(copy / "model.safetensors")
        edit(state)
        save_file(state, copy / "model.safetensors", metadata={"format": "pt"})

    return change


def _gpt2(copy: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=1, n_head=4).save_pretrained(copy)


def _qwen3_next(copy: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hp.models import tiny_config

    from safetensors.torch import save_model

    config = tiny_config("qwen3_next", layers=1, vocab_size=320)
    config.save_pretrained(copy)
    save_model(AutoModelForCausalLM.from_config(config), str(copy / "model.safetensors"))


def _file(copy: Path, name: str, text: str | bytes) -> None:
    (copy / name).write_bytes(text if isinstance(text, bytes) else text.encode())


def _remove(*names: str) -> Callable[[Path], None]:
    return lambda copy: [(copy / n).unlink() for n in names]


def _sharegpt(messages: list[dict]) -> dict:
    return {"chat": {"file_name": "chat.json", "formatting": "sharegpt"}}, json.dumps([{"conversations": messages}] * 40)


_CHAT_INFO, _BAD_TURNS = _sharegpt([{"from": "human", "value": "hi"}, {"from": "human", "value": "again"}])

# id -> (tmp, model_dir) -> (overrides, words the message must hold)
BAD = {
    "learning rate not a number": lambda t, m: (["learning_rate=fast"], "learning_rate = 'fast'"),
    "misspelt key": lambda t, m: (["lr=1e-4"], "unknown key 'lr' = '1e-4'; did you mean 'learning_rate'?"),
    "tp not dividing heads": lambda t, m: (["parallel.tp=3"], "parallel.tp = 3 does not divide num_attention_heads = 4"),
    "cp not dividing heads": lambda t, m: (["parallel.cp=4"], "parallel.cp = 4 (Ulysses) does not divide the 2 heads"),
    "stage not available": lambda t, m: (["stage=ppo"], "stage = 'ppo'"),
    "sft data under dpo": lambda t, m: (["stage=dpo"], "stage dpo trains on chosen and rejected answers, and this is "
                                                       "not a ranking dataset"),
    "ranking data under sft": lambda t, m: (["dataset=quickstart_dpo"], "a ranking dataset"),
    "port out of range": lambda t, m: (["master_port=70000"], "master_port = 70000: expected a port in [1, 65535]"),
    "workers not matching degrees": lambda t, m: (["nproc_per_node=3"],
                                                  "nproc_per_node = 3 (x nnodes = 1): 3 ranks do not split into groups "
                                                  "of cp * tp = 2"),
    "workers not matching dp": lambda t, m: (["nproc_per_node=4", "parallel.dp=1"], "nproc_per_node = 4: expected 2"),
    "bad override syntax": lambda t, m: (["bf16"], "override 'bf16': expected KEY=VALUE"),
    "unknown dataset name": lambda t, m: (["dataset=nope"], f"dataset 'nope' is not in {DATA}/dataset_info.json"),
    "no dataset_info and no file": lambda t, m: ([_data(t, {}), "dataset=alpaca"], "has no dataset_info.json and no file"),
    "truncated dataset JSON": lambda t, m: (
        [_data(t, {"a.json": _records()[:-40]}, {"a": {"file_name": "a.json"}}), "dataset=a"], "bad JSON in"),
    "empty dataset": lambda t, m: (
        [_data(t, {"a.json": "[]"}, {"a": {"file_name": "a.json"}}), "dataset=a"], "a.json): the file holds no records"),
    "missing column": lambda t, m: (
        [_data(t, {"a.json": json.dumps([{"instruction": "x"}] * 40)}, {"a": {"file_name": "a.json"}}), "dataset=a"],
        "record 0): no column 'output' (the response)"),
    "corrupt dataset_info.json": lambda t, m: (
        [_data(t, {"a.json": _records()}, '{"a": {"file_name": '), "dataset=a"], "bad JSON in"),
    "hub-only dataset": lambda t, m: (
        [_data(t, {}, {"a": {"hf_hub_url": "org/data"}}), "dataset=a"], "it names only hf_hub_url, and hp downloads nothing"),
    "dataset file missing": lambda t, m: (
        [_data(t, {}, {"a": {"file_name": "gone.json"}}), "dataset=a"], "gone.json does not exist (file_name in"),
    "record not an object": lambda t, m: (
        [_data(t, {"a.json": json.dumps(["text"] * 40)}, {"a": {"file_name": "a.json"}}), "dataset=a"],
        "record 0): expected an object, got str"),
    "bad JSON line": lambda t, m: (
        [_data(t, {"a.jsonl": '{"instruction": "x", "output": "y"}\n{"instruction": \n'}, {"a": {"file_name": "a.jsonl"}}),
         "dataset=a"], "a.jsonl at line 2"),
    "turns not alternating": lambda t, m: (
        [_data(t, {"chat.json": _BAD_TURNS}, _CHAT_INFO), "dataset=chat"], "message 1 has from='human'"),
    "mapped column in no record": lambda t, m: (
        [_data(t, {"a.json": _records()}, {"a": {"file_name": "a.json", "columns": {"prompt": "text"}}}), "dataset=a"],
        "column 'text' (the prompt, named in dataset_info.json) is in no record"),
    "too few examples for a batch": lambda t, m: (["max_samples=3"], "3 examples cannot fill one batch of 4"),
    "csv file": lambda t, m: (
        [_data(t, {"a.csv": "a,b\n"}, {"a": {"file_name": "a.csv"}}), "dataset=a"], "only .json and .jsonl files are read"),
    "sharegpt for pretraining": lambda t, m: (
        [_data(t, {"chat.json": _BAD_TURNS}, _CHAT_INFO), "dataset=chat", "stage=pt"], "stage pt reads plain text"),
    "template unknown": lambda t, m: (["template=nope"], "template = 'nope': expected one of"),
    "evaluation without data": lambda t, m: (["eval_strategy=steps"], "has nothing to evaluate on: expected val_size"),
    "val_size holding out everything": lambda t, m: (
        ["val_size=2000"], "val_size = 2000 holds out 2000 of the 2000 training examples"),
    "unknown eval dataset": lambda t, m: (
        ["eval_dataset=nope", "do_eval=true"], f"dataset 'nope' is not in {DATA}/dataset_info.json"),
    "every problem at once": lambda t, m: (
        ["lr=1e-4", "bf16=maybe", "deepspeed=ds_z3.json"], "3 problems in the config:\n  - unknown key 'lr'"),
    "model directory missing": lambda t, m: (
        [f"model_name_or_path={t / 'nothing'}"], "is neither 'hp/tiny-llama' nor a local directory"),
    "model without tokenizer": lambda t, m: (
        [_model(t, m, _remove("tokenizer.json", "tokenizer_config.json"))], "holds no HF tokenizer"),
    "model without weights": lambda t, m: ([_model(t, m, _drop_weights)], "holds no *.safetensors weights"),
    "model with pickled weights only": lambda t, m: (
        [_model(t, m, _pickled_weights)], "it has pytorch_model.bin: hp reads safetensors only"),
    "weight of another shape": lambda t, m: (
        [_model(t, m, _edit_weights(lambda s: s.update({"model.norm.weight": s["model.norm.weight"][:8]})))],
        "weight 'model.norm.weight' has shape [8] in model.safetensors, but its config.json makes it [64]"),
    "weight missing": lambda t, m: (
        [_model(t, m, _edit_weights(lambda s: s.pop("model.layers.1.mlp.down_proj.weight")))],
        "no weight 'model.layers.1.mlp.down_proj.weight' in its safetensors"),
    "untied head missing": lambda t, m: (  # what a tied model stores under its embedding alone
        [_model(t, m, _edit_weights(lambda s: s.pop("lm_head.weight")))], "no weight 'lm_head.weight' in its safetensors"),
    "corrupt safetensors": lambda t, m: (
        [_model(t, m, lambda c: _file(c, "model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"))],
        "model.safetensors is not a readable safetensors file"),
    "corrupt config.json": lambda t, m: ([_model(t, m, lambda c: _file(c, "config.json", "{"))], "model_name_or_path = "),
    "model type without a plan": lambda t, m: (
        [_model(t, m, _gpt2)], "no model plan for model_type 'gpt2': hp derives plans for the causal LMs"),
    "family with a layer hp cannot split": lambda t, m: (
        [_model(t, m, _qwen3_next)], "Qwen3NextForCausalLM has linear-attention (Qwen3NextGatedDeltaNet) layers, which "
                                     "hp cannot split over tp yet; dp and FSDP run any family"),
    "lora targets naming nothing": lambda t, m: (
        ["finetuning_type=lora", "lora_target=qkv"],
        "finetuning_type = 'lora': lora targets = ('qkv',) match no nn.Linear of LlamaForCausalLM"),
    "hyper_parallel_args file missing": lambda t, m: (
        ["use_hyper_parallel=true", "hyper_parallel_args=nope.json"], "hyper_parallel_args = 'nope.json': expected the path"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_input_is_one_message_before_any_worker(case, finished_run, model_dir, tmp_path, run_here):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    before = _snapshot(out)
    overrides, words = BAD[case](tmp_path, model_dir)
    code, err = run_here(f"output_dir={out}", "overwrite_output_dir=true", *overrides)
    assert_one_message(code, err, words)
    assert _snapshot(out) == before


def test_bad_config_files(tmp_path, run_here):
    missing = run_here(config=str(tmp_path / "none.yaml"))
    assert_one_message(*missing, "none.yaml' does not exist: expected the path of a YAML file")
    (tmp_path / "bad.yaml").write_text("dataset: [unclosed\n")
    assert_one_message(*run_here(config=str(tmp_path / "bad.yaml")), "is not valid YAML")
    (tmp_path / "twice.yaml").write_text(Path(QUICKSTART).read_text() + "cutoff_len: 8\n")
    assert_one_message(*run_here(config=str(tmp_path / "twice.yaml")), "key 'cutoff_len' is given twice")


def test_a_device_this_machine_lacks(tmp_path, run_here):
    from hp.device import available

    missing = next(d for d in ("cuda", "npu") if d != available())
    code, err = run_here(f"device={missing}", f"output_dir={tmp_path / 'out'}")
    assert_one_message(code, err, f"device = '{missing}' is not available on this machine")
    assert not (tmp_path / "out").exists()


def test_tensorboard_asked_for_but_not_installed(tmp_path, run_here, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if the package were absent: import fails
    code, err = run_here("report_to=tensorboard", f"output_dir={tmp_path / 'out'}")
    assert_one_message(code, err, "report_to = 'tensorboard' needs the tensorboard package, which is not installed")
    assert not (tmp_path / "out").exists()


def test_a_busy_master_port(tmp_path, run_here):
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_here(f"master_port={port}", f"output_dir={tmp_path / 'out'}")
    assert_one_message(code, err, f"master_port = {port} cannot be used on this machine")


def test_bad_output_dirs(finished_run, tmp_path, run_here):
    (tmp_path / "file").write_text("not a directory")
    assert_one_message(*run_here(f"output_dir={tmp_path / 'file'}"), "output_dir = ")
    assert_one_message(*run_here(f"output_dir={tmp_path / 'file' / 'run'}"), "is a file, so no directory can be made")
    assert (tmp_path / "file").read_text() == "not a directory"
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _snapshot(out)
    assert_one_message(*run_here(f"output_dir={out}", "overwrite_output_dir=false"),
                       "already holds a run; set overwrite_output_dir: true")
    assert _snapshot(out) == before


def test_bad_resume_points(finished_run, tmp_path, run_here):
    assert_one_message(*run_here(f"output_dir={tmp_path / 'new'}", "resume_from_checkpoint=last"),
                       "resume_from_checkpoint = 'last': output_dir = ")
    assert not (tmp_path / "new").exists()
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _snapshot(out)
    assert_one_message(*run_here(f"output_dir={out}", f"resume_from_checkpoint={out / 'checkpoint-9'}"),
                       "checkpoint-9 is not a complete hp checkpoint")
    (out / "checkpoint-2" / checkpoint.TRAINER_STATE).rename(out / "state")  # as a save cut short leaves it
    assert_one_message(*run_here(f"output_dir={out}", f"resume_from_checkpoint={out / 'checkpoint-2'}"),
                       "checkpoint-2 is not a complete hp checkpoint")
    (out / "state").rename(out / "checkpoint-2" / checkpoint.TRAINER_STATE)
    assert_one_message(*run_here(f"output_dir={out}", "resume_from_checkpoint=last", "seed=7"),
                       "cannot resume the batch stream: seed 42 -> 7 since it was saved")
    assert _snapshot(out) == before


class _Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("planted", [checkpoint.TRAINER_STATE, ".metadata"])
def test_a_checkpoint_holding_code_is_refused_unrun(planted, finished_run, tmp_path, run_here, capfd):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    marker = tmp_path / PWNED
    target = out / "checkpoint-2" / planted
    if planted == ".metadata":  # DCP's index, which torch itself unpickles: keep it working, add the payload
        with open(target, "rb") as f:
            index = pickle.load(f)
        index.storage_meta = _Payload(marker)
        target.write_bytes(pickle.dumps(index))
    else:
        import torch

        state = torch.load(target, weights_only=True)
        torch.save({**state, "hook": _Payload(marker)}, target)
    manifest.write(str(target.parent))  # as whoever planted it would: the manifest proves no intent
    code, err = run_here(f"output_dir={out}", "resume_from_checkpoint=last")
    assert_one_message(code, err, "which loading would have to run as code; refusing it")
    assert "posix.system" in err or "os.system" in err
    from hp.cli import main

    exported = main(["export", str(out / "checkpoint-2"), str(tmp_path / "hf")])
    err = capfd.readouterr().err
    if planted == ".metadata":  # export reads the weights through DCP's index (and never the trainer state)
        assert exported == 2 and err.startswith("hp export: ") and "refusing it" in err and "Traceback" not in err
    assert not marker.exists(), "the planted pickle ran"


# ---------------------------------------------------------------- what only the workers meet


def _strict_json(line: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("stop", ["SIGINT to the process group", "SIGTERM"])  # SIGKILL: test_train.py, the killed run
def test_stopping_the_launcher_stops_every_worker(stop, tmp_path):
    out = tmp_path / "run"
    run = hp_train("max_steps=500", "save_steps=1", f"output_dir={out}", wait=False)
    deadline = time.time() + 300
    while not (out / "checkpoint-1").is_dir():
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    # the launcher, its zygote, two workers and their stand-ins, found by their command lines
    assert len(workers(str(out))) == 6 and set(ranks(str(out))) == {0, 1}
    if stop.startswith("SIGINT"):
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in a terminal
    else:
        run.send_signal(getattr(signal, stop))
    _, err = run.communicate(timeout=120)
    assert_stopped_whole(out, stop)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err and len(_lines(err)) < 15, err
    assert _lines(err)[-1] == "hp train: interrupted"


def test_a_killed_worker_is_named_with_its_signal_the_last_checkpoint_and_the_command_that_resumes(tmp_path):
    """SIGKILL to rank 1 (as the out-of-memory killer sends it): the one message names rank 1 and the signal,
    not rank 0's symptom (a connection closed by its peer), on its own line, then how to resume."""
    out = tmp_path / "run"
    run = hp_train("max_steps=500", "save_steps=2", "logging_steps=1", f"output_dir={out}", wait=False)
    deadline = time.time() + 300
    while not (out / "checkpoint-2").is_dir():
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    os.kill(worker_of_rank(str(out), 1), signal.SIGKILL)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err[-3000:]
    message = _lines(err)[-1]
    assert message.startswith("hp train: worker rank 1 was killed by SIGKILL (what the kernel's out-of-memory "
                              "killer or a cluster scheduler does); its peak memory when step "), message
    assert "the other ranks stopped when it left (0)" in message and "Connection closed" not in message
    assert f"the last complete checkpoint is {out}/checkpoint-" in message
    assert message.endswith("resume_from_checkpoint=last") and f"output_dir={out}" in message


def test_a_collective_timeout_names_the_collective_and_the_rank_that_never_joined(tmp_path):
    """Rank 1 frozen (SIGSTOP) mid-run with ddp_timeout 4 s: rank 0 waits out the timeout in its next
    collective, and the message names rank 0, the collective and where it was called, rank 1 as the one that
    never joined and where it was (read when the launcher stopped it), and the hint on ddp_timeout."""
    out = tmp_path / "run"
    run = hp_train("max_steps=500", "logging_steps=1", "ddp_timeout=4", f"output_dir={out}", wait=False)
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    first, frozen = worker_of_rank(str(out), 0), worker_of_rank(str(out), 1)
    os.kill(frozen, signal.SIGSTOP)
    while first in workers(str(out)) and time.time() < deadline:
        time.sleep(0.1)  # rank 0 times out and leaves; then rank 1 wakes to the launcher's SIGTERM
    os.kill(frozen, signal.SIGCONT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err[-3000:]
    message = _lines(err)[-1]
    assert " called at " in message, message
    # a rank frozen inside a collective wakes past its own deadline and times out too, before its SIGTERM
    # handler runs: then both ranks waited in the same collective, or (its collective in flight, which the
    # other rank had already passed) in different ones, which the message says
    stopped = message.startswith("hp train: rank 0 waited out ddp_timeout in ") and "; rank 1 (it was " in message \
        and ") never joined it" in message
    both = message.startswith("hp train: ranks 0, 1 waited out ddp_timeout in ") and \
        "every rank was in it, so one was held up" in message
    apart = message.startswith("hp train: every rank waited out ddp_timeout, in different collectives (rank 0 in ") \
        and "; rank 1 in " in message and "or one was held up (a process stopped" in message
    assert stopped or both or apart, message
    assert "needs a larger ddp_timeout" in message and "Connection closed" not in message, message


@pytest.mark.parametrize("records, exit_codes, nodes, expected", [
    ([{"rank": 0, "kind": "timeout", "message": "m", "exit_code": 1, "collective": "all_reduce", "where": "a.py:1 in f"},
      {"rank": 1, "kind": "timeout", "message": "m", "exit_code": 1, "collective": "broadcast", "where": "b.py:2 in g"}],
     {0: 1, 1: 1}, 1, "every rank waited out ddp_timeout, in different collectives (rank 0 in all_reduce called at "
                       "a.py:1 in f; rank 1 in broadcast called at b.py:2 in g): the ranks called collectives in "
                       "different orders, or one was held up (a process stopped or swapped out) after the others had "
                       "passed its collective"),
    ([{"rank": 2, "kind": "timeout", "message": "m", "exit_code": 1, "collective": "all_gather"}],
     {2: 1}, 2, "rank 2 waited out ddp_timeout in all_gather; the ranks that never joined it are on another node"),
    ([{"rank": 0, "kind": "timeout", "message": "m", "exit_code": 1}], {0: 1, 1: -9}, 1,
     "rank 0 waited out ddp_timeout in a collective; rank 1 never joined it"),
    ([{"rank": r, "kind": "timeout", "message": "m", "exit_code": 1, "collective": "all_reduce"} for r in (0, 1)],
     {0: 1, 1: 1}, 1, "ranks 0, 1 waited out ddp_timeout in all_reduce; every rank was in it, so one was held up "
                      "inside it (a process stopped or swapped out, a link that broke)"),
    ([{"rank": 2, "kind": "RuntimeError", "message": "RuntimeError: Connection closed by peer", "exit_code": 1}],
     {2: 1, 3: 130}, 2, "rank 2 lost a peer (RuntimeError: Connection closed by peer): a worker on another node "
                        "ended first, and that node's hp train says which and why"),
])
def test_how_a_failed_round_is_told(records, exit_codes, nodes, expected):
    """Collectives that timed out (in different orders, across nodes, a stuck rank SIGKILLed after ignoring
    SIGTERM), and a node that saw only its peers' symptoms."""
    from hp.train.post_mortem import cause

    assert cause(records, exit_codes, "/nonexistent", nodes=nodes).text.split("; a rank that is slow")[0] == expected


def test_two_runs_on_one_machine_both_end_as_alone_one_diverging_at_its_step(tmp_path):
    """Two launches at once, neither given a master_port: they do not collide. One finishes its step; the other
    diverges (learning rate 1e4) and stops at the step whose loss is not finite, keeping the checkpoint of the
    step before, with one message and exit code 1."""
    finishing, diverging = tmp_path / "finishing", tmp_path / "diverging"
    runs = launch([*FAST, "max_steps=1", "run_name=twin", f"output_dir={finishing}"],
                  ["max_steps=30", "save_steps=1", "logging_steps=1", "learning_rate=1e4", "run_name=twin",
                   f"output_dir={diverging}"])
    (out, err), (_, diverged) = (run.communicate(timeout=600) for run in runs)
    assert runs[0].returncode == 0, err[-3000:]
    assert _strict_json(out.strip().splitlines()[-1])["steps"] == 1
    for told in (err, diverged):
        assert "hp train: note: run_name = 'twin' has no effect here (runs are named by output_dir" in told  # LlamaFactory's
    assert runs[1].returncode == 1, diverged[-3000:]
    assert "Traceback" not in diverged and len(_lines(diverged)) < 15, diverged
    message = _lines(diverged)[-1]
    assert message.startswith("hp train: step ") and "training diverged and stopped" in message, message
    step = int(message.split("step ")[1].split(":")[0])
    kept = checkpoint.latest(str(diverging))
    assert kept == str(diverging / f"checkpoint-{step - 1}") and f"the last good checkpoint is {kept}" in message
    assert checkpoint.trainer_state(kept)["step"] == step - 1
    records = [_strict_json(line) for line in (diverging / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, step))


_MODEL_ONLY = """
import json, sys, torch
from transformers import LlamaForCausalLM
from hp.train import checkpoint
from hp.train.data.embedded import tiny_llama_config

model = LlamaForCausalLM(tiny_llama_config(259))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.ones(1, 4, dtype=torch.long)
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
saved = checkpoint.save(sys.argv[1], 1, model, optimizer, {"scheduler": {}, "data": {}}, model_only=True)
copy = LlamaForCausalLM(tiny_llama_config(259))
checkpoint.load_model_weights(saved, copy)
print(json.dumps({"same": torch.equal(copy.lm_head.weight, model.lm_head.weight)}))
"""


def test_a_model_only_checkpoint_exports_but_does_not_resume(tmp_path, run_here):
    """save_only_model: the optimizer state is left out, the weights still load, a resume is refused by name."""
    # a process of its own: checkpoints read and write through the process group when one exists
    made = rank_pool.python("-c", _MODEL_ONLY, str(tmp_path), timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads(made.stdout.splitlines()[-1]) == {"same": True}
    with open(tmp_path / "checkpoint-1" / ".metadata", "rb") as f:
        stored = pickle.load(f).state_dict_metadata
    assert stored and all(key.startswith("model.") for key in stored)
    code, err = run_here(f"output_dir={tmp_path}", "resume_from_checkpoint=last")
    assert_one_message(code, err, "was saved with save_only_model: true, so it holds no optimizer state to resume")

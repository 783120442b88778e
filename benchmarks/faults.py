"""Faults survived: workers killed mid-run, damaged checkpoints, and what saving costs a step.

Three parts, one run (about eight minutes on 2 CPU cores; 2 real gloo workers, the quickstart's tiny Llama):

1. **Kills.** A reference run (`max_steps` steps, a checkpoint every `save_steps`), then one run per
   kill point with `max_restarts: 1`: rank 1 is SIGKILLed (what the out-of-memory killer sends) once the
   run has logged the drawn step, the group restarts from the last complete checkpoint, and the fault
   counts as survived when the run finishes with exit code 0, its summary lists the restart, and its loss
   at every step equals the reference's.
2. **Damaged checkpoints.** Each kind of checkpoint file (the trainer state, DCP's index, each rank's
   DCP data, the model config, the manifest) cut short, and each (but the manifest) with one flipped
   byte, in the newest checkpoint of a finished run: skipped when `resume_from_checkpoint: last` takes
   the one before it (`hp.train.checkpoint.latest`, which checks the manifest).
3. **Save stall.** A larger Llama (hidden 512, 6 layers, 17 M parameters: a 195 MB checkpoint with
   AdamW's states, against about half a second a step at 8 sequences a rank), with a checkpoint every 10
   steps written in the background (hp's default) or synchronously (`async_save: false`), and without
   any; the three arms alternate, twice. The quickstart's own model saves 5 MB, too little to see.
   Each step's time is the gap between the arrivals of its line in metrics.jsonl. `save_stall_ratio`
   is the median step time with background saves over none (the issue's measure), `save_stall_ratio_mean`
   the means' ratio, which counts the saving steps in full; `save_stall_ratio_sync_mean` is the same
   for synchronous saves.

Last line: `faults_injected`, `faults_survived`, `damaged_checkpoints_tried`, `damaged_checkpoints_skipped`,
`save_stall_ratio`, `save_stall_ratio_mean`, `save_stall_ratio_sync_mean`.

    python benchmarks/faults.py [--kills 10] [--steps 40] [--parts kills,damaged,stall]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = [str(ROOT / "examples" / "quickstart.yaml"), f"dataset_dir={ROOT / 'examples' / 'data'}"]


def hp_train(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hp.cli", "train", *QUICKSTART, *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def losses(output_dir: Path) -> dict[int, float]:
    with open(output_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def logged_step(output_dir: Path) -> int:
    try:
        return max([0, *losses(output_dir)])
    except (OSError, ValueError):
        return 0


def worker_of_rank(output_dir: Path, rank: int) -> int | None:
    """The pid of `rank`'s worker of the run writing to `output_dir`."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hp.train.worker" in command and str(output_dir).encode() in command and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def kill_at(step: int, run: list[str], reference: dict[int, float], out: Path) -> dict:
    """One run with max_restarts: 1 whose rank 1 is SIGKILLed once `step` is logged."""
    proc = hp_train(*run, "max_restarts=1", f"output_dir={out}")
    deadline = time.time() + 300
    while logged_step(out) < step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    pid = worker_of_rank(out, 1)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    summary = json.loads(stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    got = losses(out) if out.exists() else {}
    survived = proc.returncode == 0 and len(summary.get("restarts", [])) == 1 and got == reference
    return {"kill_at_step": step, "killed": pid is not None, "returncode": proc.returncode,
            "restarts": summary.get("restarts"), "losses_identical": got == reference, "survived": survived,
            **({} if proc.returncode == 0 else {"error": stderr.strip().splitlines()[-1][-300:]})}


def damaged(finished: Path, work: Path) -> list[dict]:
    """Each kind of file of the newest checkpoint cut short or with a flipped byte: is it passed over?"""
    from hp.train import checkpoint, manifest

    newest = checkpoint.latest(str(finished))
    names = sorted(os.listdir(newest))
    kinds = [n for n in names if n in ("trainer_state.pt", ".metadata", "config.json", manifest.MANIFEST)
             or n.endswith(".distcp")]
    lines = []
    for name in kinds:
        for damage in ("cut", "flip"):
            if damage == "flip" and name == manifest.MANIFEST:
                continue  # a flip there may leave the checkpoint's own files intact, and they are
            out = work / f"{name}-{damage}"
            shutil.copytree(finished, out)
            file = Path(out, Path(newest).name, name)
            data = bytearray(file.read_bytes())
            if damage == "cut":
                data = data[: len(data) // 2]
            else:
                data[len(data) // 2] ^= 0x01
            file.write_bytes(bytes(data))
            skipped: list = []
            taken = checkpoint.latest(str(out), skipped)
            lines.append({"file": name, "damage": damage, "taken": Path(taken).name if taken else None,
                          "skipped": bool(skipped) and taken is not None and taken != str(out / Path(newest).name)})
    return lines


def larger_model(directory: Path) -> Path:
    """The embedded Llama's config and byte tokenizer, widened to hidden 512 and 6 layers, as a HF directory."""
    from transformers import AutoModelForCausalLM

    from hp.train.data import load_tokenizer
    from hp.train.data.embedded import TINY_LLAMA, tiny_llama_config

    tokenizer = load_tokenizer(TINY_LLAMA)
    tokenizer.save_pretrained(directory)
    config = tiny_llama_config(tokenizer.vocab_size)
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
                   "num_key_value_heads": 4})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def step_times(run: list[str], out: Path) -> list[float]:
    """Each step's wall time: the gaps between the arrivals of metrics.jsonl's lines."""
    proc = hp_train(*run, "logging_steps=1", f"output_dir={out}")
    seen, arrivals = 0, []
    while proc.poll() is None:
        step = logged_step(out)
        if step > seen:
            arrivals += [time.perf_counter()] * (step - seen)
            seen = step
        time.sleep(0.002)
    proc.communicate()
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--parts", default="kills,damaged,stall", help="which parts to run, comma-separated")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    run = [f"max_steps={args.steps}", "save_steps=5", "logging_steps=1"]
    last: dict = {}
    with tempfile.TemporaryDirectory(prefix="hp-faults-") as tmp:
        work = Path(tmp)
        reference = work / "reference"
        if parts & {"kills", "damaged"}:
            hp_train(*run, f"output_dir={reference}").communicate()
        if "kills" in parts:
            want = losses(reference)
            points = [2 + (i * (args.steps - 6)) // max(args.kills - 1, 1) for i in range(args.kills)]
            kills = []
            for i, step in enumerate(points):
                kills.append(kill_at(step, run, want, work / f"kill-{i}"))
                print(json.dumps(kills[-1]), flush=True)
            last |= {"faults_injected": len(kills), "faults_survived": sum(k["survived"] for k in kills)}
        if "damaged" in parts:
            damages = damaged(reference, work / "damaged")
            for line in damages:
                print(json.dumps(line), flush=True)
            last |= {"damaged_checkpoints_tried": len(damages),
                     "damaged_checkpoints_skipped": sum(d["skipped"] for d in damages)}
        if "stall" in parts:
            last |= save_stall(args.steps, work)
    print(json.dumps(last))


def save_stall(steps: int, work: Path) -> dict:
    """Step times with background saves, synchronous saves and none, the arms alternating."""
    model = larger_model(work / "model")
    arms = {"background": ["save_steps=10"], "synchronous": ["save_steps=10", "async_save=false"],
            "none": [f"save_steps={10 * steps}"]}
    timed: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(2):
        for arm, overrides in arms.items():
            run = [f"max_steps={steps}", f"model_name_or_path={model}", "per_device_train_batch_size=8", *overrides]
            timed[arm] += step_times(run, work / f"timed-{arm}-{i}")
    median = {arm: statistics.median(t) for arm, t in timed.items()}
    mean = {arm: statistics.mean(t) for arm, t in timed.items()}
    print(json.dumps({"step_seconds_median": {k: round(v, 4) for k, v in median.items()},
                      "step_seconds_mean": {k: round(v, 4) for k, v in mean.items()}}), flush=True)
    return {"save_stall_ratio": round(median["background"] / median["none"], 3),
            "save_stall_ratio_mean": round(mean["background"] / mean["none"], 3),
            "save_stall_ratio_sync_mean": round(mean["synchronous"] / mean["none"], 3)}


if __name__ == "__main__":
    main()

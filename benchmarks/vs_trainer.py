"""`hp train` against HF Trainer (what LlamaFactory runs) on one config: step time, wall time, peak memory, losses.

Why: a user who first tries hp on the everyday data-parallel config compares
it with the trainer they have. This runs both on the same model directory,
the same tokenized rows in the same order, and the same hyperparameters:

- `hf_ddp`: `transformers.Trainer` under torchrun (accelerate's DDP), fed
  the rows hp's data layer made, in hp's order (a sequential sampler: global
  step i takes the same rows under every arm);
- `hf_fsdp`: the same with FSDP2 full-shard per decoder layer (`fsdp="full_shard auto_wrap"`,
  `fsdp_version: 2`), DeepSpeed ZeRO-3's analogue (accelerate takes FSDP
  on accelerators only and runs DDP instead on CPU; there the arm hands its
  state the FSDP plugin, so Trainer's own FSDP2 path runs over gloo, and
  skips the final save, whose full state dict fails in accelerate on CPU);
- `llamafactory`: LlamaFactory's own engine (`llamafactory-cli train`) on the
  same YAML, when `--llamafactory-python` names a Python that has it (it
  tokenizes and orders the data itself, so only its speed compares);
- `hp_dp`, `hp_fsdp`, `hp_tp`: `hp train` at dp=2, dp=2 with FSDP, and tp=2
  at the same global batch;
- on one accelerator (`--shape gpu`, the GPU check): `plain` (a plain
  PyTorch loop over the same rows: forward with labels, backward, clipping,
  AdamW), `hf` and `hp` (one rank each), and `hp_compile` (`compile: true`).

Every arm is a fresh launch timed from outside (wall, start-up included);
each rank process (found under the launcher) has every thread bound to its
own core, as `taskset -a` would, and its peak resident memory read from
/proc while it runs (on an accelerator: the allocator's peak, which the run
reports). A step's time is the time between consecutive step ends on rank 0;
the median after `warmup` steps is reported, with the loss at every step.
Arms run in rounds (`--rounds`), the order rotating, so a slow spell of this
shared machine hits each alike.

Shapes: `cpu` (the default) is the config of the comparison that motivated
it: full SFT of a 4-layer, hidden-256 Qwen3 with its own BPE tokenizer,
template `qwen3_nothink`, `cutoff_len` 512, batch 4 per device, 40 steps,
gradient checkpointing on, 2 gloo ranks. The data are alpaca-style records
of made-up words drawn in the script (no hub here), 60-400 tokens each.
`tiny` is the same code in about a minute; `gpu` is a 0.9B Llama, pt at
batch 8 x 2048, bf16 autocast, no checkpointing, 20 steps, one device
(`gpu_tiny`: its code on CPU, fp32).

Last line: `step_ratio_<arm>` = the arm's median step / `hf_ddp`'s (`hf` on
one device; `plain` is the reference there: `hp_tokens_vs_plain`), the same
for wall; the targets `step_ratio_vs_trainer_ddp` (hp_dp / hf_ddp),
`step_ratio_vs_trainer_fsdp` (hp_fsdp / hf_fsdp), `wall_ratio_vs_trainer`
and `peak_ratio_vs_trainer` (hp_dp / hf_ddp, peak memory per rank); and
`losses_match` (every arm fed hp's rows has each step's loss
within 1e-4 relative of `hf_ddp`'s in fp32, the same sums in another order
amplified over the steps; 2e-2 under bf16 autocast).

    python benchmarks/vs_trainer.py [--rounds 1]             # CPU, 2 ranks: about 10 minutes a round
    python benchmarks/vs_trainer.py --shape tiny --arms hp_dp,hf_ddp
    python benchmarks/vs_trainer.py --shape gpu              # one GPU or NPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from ranks import free_port

SHAPES = {
    "cpu": dict(family="qwen3", hidden=256, layers=4, heads=4, kv_heads=2, ffn=768, vocab=8000, stage="sft",
                cutoff=512, batch=4, steps=40, warmup=5, ranks=2, recompute=True, bf16=False, records=2000),
    "tiny": dict(family="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1000, stage="sft",
                 cutoff=128, batch=2, steps=6, warmup=2, ranks=2, recompute=True, bf16=False, records=200),
    "gpu": dict(family="llama", hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000, stage="pt",
                cutoff=2048, batch=8, steps=20, warmup=5, ranks=1, recompute=False, bf16=True, records=600),
    "gpu_tiny": dict(family="llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=1000, stage="pt",
                     cutoff=128, batch=2, steps=6, warmup=2, ranks=1, recompute=False, bf16=False, records=100),
}
ARMS_RANKS = ("hf_ddp", "hf_fsdp", "llamafactory", "hp_dp", "hp_fsdp", "hp_tp")
ARMS_ONE = ("plain", "hf", "hp", "hp_compile")
HP_OVERRIDES = {"hp_dp": [], "hp_tp": [], "hp_fsdp": ["parallel.fsdp=true"], "hp": [], "hp_compile": ["parallel.compile=true"]}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's chat tokens; eos is <|im_end|>


# ---- the shared inputs: data, tokenizer, model directory, hp's rows -------------------------------------------

def make_inputs(shape: dict, work: Path) -> None:
    """Write the dataset, a BPE tokenizer trained on it, the model directory and the config every arm reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    records = _records(shape)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "bench.json").write_text(json.dumps(records))
    columns = {"prompt": "text"} if shape["stage"] == "pt" else {"prompt": "instruction", "query": "input",
                                                                 "response": "output"}
    (data / "dataset_info.json").write_text(json.dumps({"bench": {"file_name": "bench.json", "columns": columns}}))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator((" ".join(r.values()) for r in records),
                            trainers.BpeTrainer(vocab_size=shape["vocab"], special_tokens=["<unk>", *SPECIALS]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    model_dir = work / "model"
    tokenizer.save_pretrained(model_dir)
    config = AutoConfig.for_model(
        shape["family"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["ffn"], vocab_size=-(-len(tokenizer) // 64) * 64,  # rows tp can split
        max_position_embeddings=max(4096, shape["cutoff"]),
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    (work / "hp.yaml").write_text(json.dumps(_train_config(shape, work)))


def _records(shape: dict) -> list[dict]:
    """Alpaca-style records (pt: documents) of made-up words with a Zipf-like frequency."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "xi", "qu", "ber", "ton", "sha"]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(6000)})
    weights = [1 / (i + 1) for i in range(len(words))]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, weights, k=rng.randint(lo, hi)))

    if shape["stage"] == "pt":
        return [{"text": text(300, 2000)} for _ in range(shape["records"])]
    return [{"instruction": text(8, 40), "input": text(0, 60) if rng.random() < 0.5 else "",
             "output": text(30, 200)} for _ in range(shape["records"])]


def _train_config(shape: dict, work: Path) -> dict:
    """The hp / LlamaFactory config (LlamaFactory's key names) every arm runs."""
    return {
        "model_name_or_path": str(work / "model"), "stage": shape["stage"], "do_train": True,
        "finetuning_type": "full", "dataset": "bench", "dataset_dir": str(work / "data"),
        "template": "qwen3_nothink", "cutoff_len": shape["cutoff"], "per_device_train_batch_size": shape["batch"],
        "max_steps": shape["steps"], "learning_rate": 1.0e-4, "lr_scheduler_type": "linear", "logging_steps": 1,
        "save_steps": shape["steps"], "report_to": "none", "seed": 42, "bf16": shape["bf16"],
        "disable_gradient_checkpointing": not shape["recompute"], "output_dir": str(work / "out"),
    }


def hp_rows(work: Path, ranks: int) -> list[dict]:
    """The rows of hp's first `max_steps` global batches, in order (what the HF arms and `plain` are fed)."""
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples, load_tokenizer

    config = load_config(str(work / "hp.yaml"), [f"nproc_per_node={ranks}"])
    tokenizer = load_tokenizer(config.model_name_or_path)
    batches = TokenBatches(load_examples(config, tokenizer), config.per_device_train_batch_size * ranks,
                           config.seed, tokenizer.pad_token_id)
    rows = []
    for _ in range(config.max_steps):
        batch = next(batches)
        for ids, labels in zip(batch.input_ids, batch.labels):
            keep = int((labels != -100).nonzero().max()) + 1  # hp's padding is the HF collator's to add
            rows.append({"input_ids": ids[:keep].tolist(), "labels": labels[:keep].tolist()})
    return rows


# ---- launching an arm and watching its ranks ----------------------------------------------------------------

def run_arm(arm: str, shape: dict, work: Path, args) -> dict:
    """Launch `arm`, bind and watch its ranks, and read its per-step figures back."""
    out = work / "out" / f"{arm}-{len(list((work / 'out').glob(f'{arm}-*'))) if (work / 'out').is_dir() else 0}"
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = _command(arm, shape, work, out, args)
    start = time.perf_counter()
    # cwd: not the source tree, whose hp/ (first on sys.path under `python -m`) lacks hp.models
    process = subprocess.Popen(command, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = RankWatcher(process.pid, shape["ranks"])
    watcher.start()
    output, _ = process.communicate(timeout=args.timeout)
    wall = time.perf_counter() - start
    watcher.stop()
    if process.returncode != 0:
        return {"arm": arm, "error": output[-3000:]}
    steps = _steps(arm, out)
    times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])][shape["warmup"] - 1:]
    memory = max(watcher.peaks.values(), default=None) if args.cpu else steps[-1]["device_peak_bytes"]
    return {"arm": arm, "step_s": round(statistics.median(times), 4), "wall_s": round(wall, 1),
            "peak_bytes_per_rank": memory, "losses": [round(s["loss"], 5) for s in steps],
            "tokens_per_s": round(shape["batch"] * shape["ranks"] * shape["cutoff"] / statistics.median(times))
                            if shape["stage"] == "pt" else None}  # packed rows: every row holds cutoff tokens


def _command(arm: str, shape: dict, work: Path, out: Path, args) -> list[str]:
    if arm.startswith("hp"):
        ranks = ["nproc_per_node=2", "parallel.tp=2", f"per_device_train_batch_size={2 * shape['batch']}"] \
            if arm == "hp_tp" else [f"nproc_per_node={shape['ranks']}"]
        return [sys.executable, "-m", "hp.cli", "train", str(work / "hp.yaml"), f"output_dir={out}",
                f"master_port={free_port()}", *ranks, *HP_OVERRIDES[arm]]
    if arm == "llamafactory":
        config = {**json.loads((work / "hp.yaml").read_text()), "output_dir": str(out), "overwrite_output_dir": True,
                  "save_strategy": "no", "ddp_backend": "gloo" if args.cpu else None}
        config.pop("save_steps")
        (out / "lf.yaml").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        cli = Path(args.llamafactory_python).parent / "llamafactory-cli"
        return ["env", "FORCE_TORCHRUN=1", f"NPROC_PER_NODE={shape['ranks']}", f"MASTER_PORT={free_port()}",
                str(cli), "train", str(out / "lf.yaml")]
    worker = [str(Path(__file__).resolve()), "--worker", arm, "--work", str(work), "--out", str(out),
              "--shape", args.shape]
    if shape["ranks"] == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={shape['ranks']}",
            *worker]


def _steps(arm: str, out: Path) -> list[dict]:
    """[{step, loss, time}] from hp's metrics.jsonl, the worker's steps.jsonl or LlamaFactory's trainer_log."""
    if arm.startswith("hp"):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{**r, "time": r["elapsed_s"], "device_peak_bytes": r["peak_memory_bytes"]} for r in records
                if "loss" in r]
    if arm == "llamafactory":
        records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
        return [{"step": r["current_steps"], "loss": r["loss"], "time": _seconds(r["elapsed_time"])} for r in records]
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _seconds(hms: str) -> float:
    return sum(float(part) * 60 ** i for i, part in enumerate(reversed(hms.split(":"))))


class RankWatcher(threading.Thread):
    """Binds every thread of each rank under `root` to that rank's core and records its peak resident memory."""

    def __init__(self, root: int, ranks: int):
        super().__init__(daemon=True)
        self.root, self.ranks, self.peaks, self.done = root, ranks, {}, threading.Event()
        self.cores = sorted(os.sched_getaffinity(0))

    def run(self) -> None:
        while not self.done.wait(0.2):
            for pid, rank in _ranks_under(self.root).items():
                self._bind(pid, self.cores[rank % len(self.cores)] if self.ranks > 1 else None)
                self.peaks[rank] = max(self.peaks.get(rank, 0), _peak_rss(pid))

    def _bind(self, pid: int, core: int | None) -> None:
        if core is None:
            return
        for task in _listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), {core})
            except OSError:  # the thread ended meanwhile
                pass

    def stop(self) -> None:
        self.done.set()
        self.join()


def _ranks_under(root: int) -> dict[int, int]:
    """{pid: LOCAL_RANK} of the processes below `root` that a launcher started as ranks (the lowest pid per rank)."""
    children: dict[int, list[int]] = {}
    for entry in _listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    ranks, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
        except OSError:
            continue
        if "LOCAL_RANK" in environ and int(environ["LOCAL_RANK"]) not in ranks.values():
            ranks[pid] = int(environ["LOCAL_RANK"])
    return ranks or {root: 0}


def _peak_rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1]) * 1024


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# ---- the workers: HF Trainer and the plain loop --------------------------------------------------------------

def worker(arm: str, work: Path, out: Path, shape: dict) -> None:
    """One rank of `hf_ddp`, `hf_fsdp`, `hf` or `plain`: train on hp's rows, write steps.jsonl on rank 0."""
    from transformers import AutoModelForCausalLM

    rows = torch.load(work / "rows.pt")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    pad = model.config.pad_token_id
    log = _StepLog(out / "steps.jsonl", int(os.environ.get("RANK", 0)) == 0)
    if arm == "plain":
        _plain_loop(model, rows, shape, pad, log)
    else:
        _hf_trainer(arm, model, rows, shape, pad, out, log)


class _StepLog:
    def __init__(self, path: Path, writes: bool):
        self.path, self.writes = path, writes

    def write(self, step: int, loss: float, **extra) -> None:
        if self.writes:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "time": time.perf_counter(), **extra}) + "\n")


def _collate(pad: int):
    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in rows])
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        return {"input_ids": ids, "labels": labels}  # no attention mask: causal, right padding, as hp feeds it
    return collate


def _hf_trainer(arm: str, model, rows: list[dict], shape: dict, pad: int, out: Path, log: _StepLog) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
                _fsdp_on_cpu(self)

    class Steps(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                extra = {"device_peak_bytes": _device_peak()} if torch.accelerator.is_available() else {}
                log.write(state.global_step, float(logs["loss"]), **extra)

    config = json.loads((out.parent.parent / "hp.yaml").read_text())  # out: WORK/out/ARM-ROUND
    # per decoder layer, as LlamaFactory's FSDP recipes wrap it (TRANSFORMER_BASED_WRAP)
    fsdp = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2}} if arm == "hf_fsdp" else {}
    arguments = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=shape["batch"], max_steps=shape["steps"],
        learning_rate=config["learning_rate"], lr_scheduler_type="linear", logging_steps=1, save_strategy="no",
        report_to=[], seed=42, bf16=shape["bf16"], gradient_checkpointing=shape["recompute"],
        use_cpu=not torch.accelerator.is_available(),
        ddp_backend="gloo" if not torch.accelerator.is_available() and shape["ranks"] > 1 else None,
        dataloader_drop_last=True, remove_unused_columns=False, disable_tqdm=True, **fsdp)
    trainer = InOrder(model=model, args=arguments, train_dataset=rows, data_collator=_collate(pad),
                      callbacks=[Steps()])
    trainer.train()
    if not (arm == "hf_fsdp" and not torch.accelerator.is_available()):  # accelerate's full state dict fails there
        trainer.save_model()  # what LlamaFactory does at the end, as hp train writes its last checkpoint


def _fsdp_on_cpu(trainer) -> None:
    """accelerate takes FSDP only on accelerators and runs DDP instead on CPU; this gives its CPU state the
    FSDP plugin the arguments asked for, so Trainer's own FSDP2 path (`fsdp2_prepare_model`) runs over gloo."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def _plain_loop(model, rows: list[dict], shape: dict, pad: int, log: _StepLog) -> None:
    """A plain PyTorch loop: the rows in order, autocast as configured, clipping and AdamW (fused on a device)."""
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    model.to(device).train()
    accel = device.type != "cpu"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=accel or None)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / shape["steps"])  # linear, as HF
    collate, batch = _collate(pad), shape["batch"]
    for step in range(shape["steps"]):
        inputs = {k: v.to(device) for k, v in collate(rows[step * batch:(step + 1) * batch]).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=shape["bf16"]):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decay.step()
        log.write(step + 1, loss.item(), **({"device_peak_bytes": _device_peak()} if accel else {}))


def _device_peak() -> int:
    device = torch.accelerator.current_accelerator()
    return int(torch.get_device_module(device).max_memory_allocated())


# ---- the run --------------------------------------------------------------------------------------------------

def summary(results: dict[str, list[dict]], one_device: bool, bf16: bool) -> dict:
    """Ratios of medians over rounds against the reference arm, and whether the losses of hp's rows match."""
    base = "hf" if one_device else "hf_ddp"
    ok = {arm: [r for r in runs if "error" not in r] for arm, runs in results.items()}
    step = {arm: statistics.median(r["step_s"] for r in runs) for arm, runs in ok.items() if runs}
    wall = {arm: statistics.median(r["wall_s"] for r in runs) for arm, runs in ok.items() if runs}
    peak = {arm: statistics.median(r["peak_bytes_per_rank"] for r in runs) for arm, runs in ok.items()
            if runs and all(r["peak_bytes_per_rank"] is not None for r in runs)}
    line: dict = {"summary": True}
    if base in step:
        line |= {f"step_ratio_{arm}": round(step[arm] / step[base], 3) for arm in step if arm != base}
        line |= {f"wall_ratio_{arm}": round(wall[arm] / wall[base], 3) for arm in wall if arm != base}
        reference, tolerance = ok[base][0]["losses"], 2e-2 if bf16 else 1e-4
        line["losses_match"] = all(
            len(r["losses"]) == len(reference)
            and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(r["losses"], reference))
            for arm, runs in ok.items() if arm != "llamafactory" for r in runs)
    if one_device and "plain" in step and "hp" in step:
        line["hp_tokens_vs_plain"] = round(step["plain"] / step["hp"], 3)
    for name, figures, hp_arm, hf_arm in _targets(step, wall, peak):  # the names: hp at dp=2 against Trainer's DDP (FSDP)
        if hp_arm in figures and hf_arm in figures:
            line[name] = round(figures[hp_arm] / figures[hf_arm], 3)
    line["failed"] = sorted(arm for arm, runs in results.items() if any("error" in r for r in runs))
    return line


def _targets(step: dict, wall: dict, peak: dict) -> list:
    return [("step_ratio_vs_trainer_ddp", step, "hp_dp", "hf_ddp"), ("step_ratio_vs_trainer_fsdp", step, "hp_fsdp", "hf_fsdp"),
            ("wall_ratio_vs_trainer", wall, "hp_dp", "hf_ddp"), ("peak_ratio_vs_trainer", peak, "hp_dp", "hf_ddp")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--arms", help="comma-separated arms (default: every arm the shape has)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--llamafactory-python", help="a Python with LlamaFactory installed: adds its arm")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per arm")
    parser.add_argument("--worker"), parser.add_argument("--work"), parser.add_argument("--out")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.worker:
        return worker(args.worker, Path(args.work), Path(args.out), shape)
    args.cpu = not torch.accelerator.is_available()
    if args.shape == "gpu" and args.cpu:
        raise SystemExit("vs_trainer.py: --shape gpu needs an accelerator; gpu_tiny runs its code on CPU")
    arms = args.arms.split(",") if args.arms else [
        a for a in (ARMS_ONE if shape["ranks"] == 1 else ARMS_RANKS)
        if a != "llamafactory" or args.llamafactory_python]
    unknown = set(arms) - set(ARMS_ONE if shape["ranks"] == 1 else ARMS_RANKS)
    if unknown:
        raise SystemExit(f"vs_trainer.py: arms {sorted(unknown)} do not run at shape {args.shape!r}")
    with tempfile.TemporaryDirectory(prefix="vs_trainer_") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        make_inputs(shape, work)
        torch.save(hp_rows(work, shape["ranks"]), work / "rows.pt")
        print(json.dumps({"bench": "vs_trainer", "inputs_s": round(time.perf_counter() - started, 1)}), flush=True)
        results: dict[str, list[dict]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm in arms[round_ % len(arms):] + arms[:round_ % len(arms)]:
                record = run_arm(arm, shape, work, args)
                results[arm].append(record)
                print(json.dumps({"bench": "vs_trainer", "round": round_, **record}), flush=True)
    print(json.dumps({**summary(results, shape["ranks"] == 1, shape["bf16"]), "shape": args.shape, "device": _device_name(),
                      "torch": torch.__version__, "date": datetime.date.today().isoformat()}), flush=True)


def _device_name() -> str:
    if not torch.accelerator.is_available():
        return f"cpu ({len(os.sched_getaffinity(0))} cores)"
    device = torch.accelerator.current_accelerator()
    return torch.get_device_module(device).get_device_name()


if __name__ == "__main__":
    main()

"""A Llama training step under hp versus PyTorch's hand-written tensor parallel, and CP memory.

Why: to measure whether hp's layouts cost anything at run time. The same HF
`LlamaForCausalLM` (hidden 512, 4 layers, ffn 1376, 8 heads, 4 KV heads,
vocabulary 4096; batch 4 x 512 tokens; fp32) takes a step (forward with
labels, backward, AdamW) on 2 real gloo ranks launched from this script, as

- `hp`: `hp.strategy_mesh({"tp": 2})` + `hp.apply_strategy` with the Llama plan (Megatron layouts,
  vocab-parallel LM head and loss);
- `hp_sp`: the same with sequence parallel (`"sp": True`), a candidate for hp's
  fastest configuration ("best" = the fastest `hp*` configuration of the run,
  `hp_recompute` aside);
- `hp_recompute`: `hp` with activation recompute (`"recompute": True`): each
  decoder layer keeps only its input and runs again in backward. It trades
  step time for memory, so it is no candidate for "best"; the summary gives
  its peak memory and step time over `hp`'s (`recompute_peak_memory_ratio`,
  `recompute_step_ratio`) and its peak over forward + backward above the
  model's own (`recompute_act_peak_ratio`, measured as for CP below);
  `--compile` adds `hp_compile`, `hp` with `"compile": True` (each decoder
  layer and the loss under `torch.compile(fullgraph=True)`; off by default,
  compiling takes a minute; `benchmarks/overhead.py` measures it against
  eager);
- `torch`: `parallelize_module` with ColwiseParallel on q/k/v/gate/up and
  RowwiseParallel on o/down (`use_local_output=True`), embedding and LM head
  replicated, on a 1-D DeviceMesh. HF's attention reshapes with
  `(*input_shape, -1, head_dim)`, so each rank's local heads need no change;
- `torch_lp`: the same plus PyTorch's own vocab-parallel LM head
  (`ColwiseParallel(output_layouts=Shard(-1))` under `loss_parallel()`),
  hp's work split exactly: the like-for-like baseline;
- `unsharded`: the plain model on each rank (same batch), for reference.

The first warm-up step of every configuration starts from the same weights;
its loss must equal the unsharded loss to 1e-5 (relative) or the run stops.
Timed steps then run interleaved (the order rotates each round), so machine
noise hits every configuration alike; a step's time is the slowest rank's,
between barriers, and each configuration reports its median (the summary's
ratio is median over median) and its minimum. Only ratios within one run
mean anything on a shared machine, and a burst of other work spanning a
few rounds still skews medians: the summary adds min over min and the median
of same-round ratios, and the load average around the timing.

Peak memory per rank: on an accelerator, its `max_memory_allocated`. On CPU,
`torch.distributed._tools.mem_tracker.MemTracker`, a dispatch mode that lets
DTensor desugar first and then holds a weak reference to the storage of every
local tensor an op returns (plus parameters, gradients and optimizer states),
adding its bytes when first seen and subtracting them when the storage is
freed; the peak of that sum over one step after warm-up. It counts tensor
storage only (no allocator caching, no scratch memory inside kernels, no
gloo buffers), so it is exact and deterministic: the same run gives the same
bytes, unlike RSS.

Profile of `hp`, `torch` and `torch_lp` (rank 0 reports): torch.profiler's
events split a step's wall time into compute (aten ops on local tensors, i.e.
that dispatch no DTensor below them), collectives (c10d ops and their waits,
which include waiting for the slower rank) and the rest (Python: HF's code,
hp's region and kernels, DTensor dispatch and sharding propagation, the
autograd engine, the profiler's own cost), the median of 3 interleaved
steps; then, from one step each, cProfile's self time of Python code per
package (C++ reached through pybind, such as a blocking gloo collective,
counts as its Python caller's), the number of sharding propagations and
redistributions, and a dispatch mode's count of DTensor-level ops, local ops
and collectives. Then the fixed cost of one elementwise op on a tiny tensor
(plain, as a DTensor, as a DTensor inside `hp.region()`), and of a whole step
of `hp` and `torch_lp` with the same layers shrunk to hidden 64 and 2 x 32
tokens, where compute nearly vanishes and what is left is each framework's
own cost per step.

LoRA against full fine-tuning: `hp` at tp=2 with and without rank-8
adapters on every linear of the layers (`hp.add_lora`), at batch 2 x 128
tokens, where weights, gradients and AdamW's states dominate a rank's
memory: step time, MemTracker's peak per rank, and the bytes one rank sends
per step (`hp.comm.trace`); `lora_mem_ratio` and `lora_bytes_ratio` are
LoRA over full, on the summary line.

Context parallel memory: a 2-layer model (1 with `--quick`) of the same
width, batch 1, at 512, 1024 and 2048 tokens, `{"cp": 2, "cp_algorithm": A}`
(A from `--cp-algorithm`: "ring", the default, or "ulysses") against the
unsharded model (cp=1): the bytes of the distinct storages autograd saves for
backward in the forward (parameters and buffers excluded), whole model and
attention blocks only, per rank; and MemTracker's activation peak over
forward + backward. `cp_mem_ratio` = the largest rank's saved bytes at cp=2 /
those at cp=1, at the longest sequence. The cp loss must match cp=1 (1e-4).

Prints one JSON object per measurement and a summary object last, nothing
after it. The default run takes about 6 minutes on 2 shared CPU cores;
`--quick` (2 layers, batch 2 x 256 tokens, CP up to 1024 tokens) about 1.5.

    python benchmarks/llama_step.py [--quick] [--cp-algorithm ring|ulysses] [--compile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from ranks import (
    DONE,
    Emit,
    adamw,
    bucket,
    emitter,
    gathered,
    no_phase,
    run_ranks,
    short,
)
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import LlamaConfig

RANKS = 2  # tp (and cp) degree, and the number of processes launched
RECOMPUTE = "hp_recompute"  # the variant with activation recompute: memory for time, never "best"
LORA_BATCH, LORA_SEQ = 2, 128  # LoRA against full fine-tuning: few tokens, so weights and states dominate memory


@dataclass(frozen=True)
class Settings:
    """Shapes and repetitions of one run (printed in the summary)."""

    vocab: int = 4096
    hidden: int = 512
    ffn: int = 1376  # Llama's 8/3 * h, rounded up to a multiple of 32
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4  # grouped-query attention, 2 kv heads per tp rank
    batch: int = 4
    seq: int = 512
    warmup: int = 2
    reps: int = 7
    cp_layers: int = 2
    cp_batch: int = 1
    cp_seqs: tuple[int, ...] = (512, 1024, 2048)
    cp_algorithm: str = "ring"
    compile: bool = False


QUICK = dict(layers=2, batch=2, seq=256, warmup=1, reps=5, cp_layers=1, cp_seqs=(256, 512, 1024))


def parse_args(argv: list[str] | None = None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps, shorter sequences")
    parser.add_argument("--cp-algorithm", default="ring", help="hp's cp_algorithm strategy key")
    parser.add_argument("--reps", type=int, help="timed steps per configuration")
    parser.add_argument("--compile", action="store_true", help="also time hp with its layers and loss compiled")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    settings = Settings(**QUICK) if args.quick else Settings()
    settings = replace(settings, cp_algorithm=args.cp_algorithm, compile=args.compile)
    if args.reps:
        settings = replace(settings, reps=args.reps)
    return settings, args.worker


# ---------------------------------------------------------------------------- launcher


def main() -> None:
    settings, is_worker = parse_args()
    if is_worker:
        worker(settings)
    else:
        launch(settings, sys.argv[1:])


def launch(settings: Settings, argv: list[str]) -> None:
    """Run this script on RANKS gloo workers; relay their JSON lines; print the summary last."""
    started = time.perf_counter()
    records, code = run_ranks(__file__, RANKS, argv, "llama_step")
    summary = summarize(records, settings)
    summary["launch_exit_code"] = code
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


def _paired(mine: dict, theirs: dict) -> float:
    """The median over rounds of (my step time / their step time in the same round)."""
    return round(statistics.median(a / b for a, b in zip(mine["seconds"], theirs["seconds"])), 4)


def _ratio(cp: dict[int, dict], key: str) -> float:
    """The largest rank's bytes at cp=RANKS over those at cp=1."""
    return round(max(cp[RANKS][key]) / max(cp[1][key]), 4)


def summarize(records: list[dict], settings: Settings) -> dict:
    """The last line: the ratios, whether they meet their targets, and the inputs."""
    steps = {r["config"]: r for r in records if r["bench"] == "tp_step"}
    medians = {name: r["median_s"] for name, r in steps.items()}
    hp_configs = {name: t for name, t in medians.items() if name.startswith("hp") and name != RECOMPUTE}
    best = min(hp_configs, key=hp_configs.get)
    peaks = {r["config"]: max(r["peak_bytes"]) for r in records if r["bench"] == "tp_memory"}
    recompute = next(r for r in records if r["bench"] == "recompute_memory")
    longest = max(settings.cp_seqs)
    cp = {r["cp"]: r for r in records if r["bench"] == "cp_memory" and r["seq"] == longest}
    summary = {
        "summary": True,
        "tp_step_ratio_vs_torch": round(medians[best] / medians["torch"], 4),
        "tp_step_ratio_vs_torch_eager": round(medians["hp"] / medians["torch"], 4),
        "tp_best_config": best,
        "tp_step_ratio_vs_torch_loss_parallel": round(medians[best] / medians["torch_lp"], 4),
        "tp_step_ratio_vs_torch_loss_parallel_eager": round(medians["hp"] / medians["torch_lp"], 4),
        "tp_median_s": medians,
        # noise-robust companions: fastest step over fastest step, and the median of the ratios
        # of steps run in the same round
        "tp_step_ratio_vs_torch_eager_min": round(steps["hp"]["min_s"] / steps["torch"]["min_s"], 4),
        "tp_step_ratio_vs_torch_eager_paired": _paired(steps["hp"], steps["torch"]),
        "tp_step_ratio_vs_torch_loss_parallel_eager_paired": _paired(steps["hp"], steps["torch_lp"]),
        "loadavg_1min_during_timing": next(r["loadavg_1min"] for r in records if r["bench"] == "machine"),
        "tp_fixed_cost_s": {r["config"]: r["median_s"] for r in records if r["bench"] == "tp_fixed_cost"},
        "tp_peak_bytes_per_rank": peaks,
        "tp_peak_ratio_vs_torch": round(peaks["hp"] / peaks["torch"], 4),
        "tp_peak_ratio_vs_torch_loss_parallel": round(peaks["hp"] / peaks["torch_lp"], 4),
        # what recompute saves at peak (max over ranks) against plain hp, and what it costs in time
        "recompute_peak_memory_ratio": round(peaks[RECOMPUTE] / peaks["hp"], 4),
        "recompute_peak_saved_bytes": peaks["hp"] - peaks[RECOMPUTE],
        "recompute_act_peak_ratio": recompute["act_peak_ratio"],
        "recompute_step_ratio": round(medians[RECOMPUTE] / medians["hp"], 4),
        "cp_mem_ratio": _ratio(cp, "saved_bytes"),
        "cp_attn_mem_ratio": _ratio(cp, "attn_saved_bytes"),
        "cp_act_peak_ratio": _ratio(cp, "act_peak_bytes"),
        "cp_algorithm": settings.cp_algorithm,
        "cp_seq": longest,
    }
    # the targets: hp's step at most 1.15 x PyTorch's, and cp=2 keeping at most 0.55 of the saved
    # activations, judged on sequences of 2048 tokens and more
    summary["targets_met"] = summary["tp_step_ratio_vs_torch"] <= 1.15 and (
        longest < 2048 or summary["cp_mem_ratio"] <= 0.55
    )
    lora = {r["config"]: r for r in records if r["bench"] == "lora_step"}
    summary["lora_step_ratio"] = round(lora["lora"]["median_s"] / lora["full"]["median_s"], 4)
    summary["lora_mem_ratio"] = round(max(lora["lora"]["peak_bytes"]) / max(lora["full"]["peak_bytes"]), 4)
    summary["lora_bytes_ratio"] = round(lora["lora"]["comm_bytes"] / lora["full"]["comm_bytes"], 4)
    # LoRA's targets: at most half the memory per rank, at most 5% more bytes moved
    summary["lora_targets_met"] = summary["lora_mem_ratio"] <= 0.5 and summary["lora_bytes_ratio"] <= 1.05
    summary["inputs"] = {**asdict(settings), "ranks": RANKS, "dtype": "float32"}
    return summary


# ---------------------------------------------------------------------------- workers


def worker(s: Settings) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    import hp  # here, not at the top: the launching process needs neither hp nor transformers

    with hp.context_parallel(s.cp_algorithm):  # an unknown algorithm fails here, before the long part
        pass
    device = _device(hp.device.detect().type)
    emit = emitter(rank)
    emit({"bench": "setup", "device": str(device), "torch": torch.__version__, **_versions()})
    run_tp(s, device, emit)
    run_lora(s, device, emit)
    run_cp(s, device, emit)
    dist.barrier()  # every rank is past its last collective
    emit({DONE: True})


def _device(kind: str) -> torch.device:
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, int(os.environ.get("LOCAL_RANK", "0")))


def _versions() -> dict:
    import transformers

    return {"transformers": transformers.__version__}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


# ---------------------------------------------------------------------------- models


def llama_config(settings: Settings, layers: int, positions: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=settings.vocab, hidden_size=settings.hidden, intermediate_size=settings.ffn,
        num_hidden_layers=layers, num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads, max_position_embeddings=positions, use_cache=False,
    )


def fresh_model(config: LlamaConfig, device: torch.device) -> nn.Module:
    """The same initial weights on every rank and for every configuration (seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def token_batch(vocab: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Random ids, equal on every rank (tensor parallel needs one global batch)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


@dataclass
class Variant:
    """One configuration: a model, its optimizer, and what its step needs around it."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    before_step: Callable[[nn.Module], None] = lambda model: None


def hp_variant(name: str, config: LlamaConfig, device: torch.device, strategy: dict, lora=None) -> Variant:
    from hp.models import plan_for

    import hp

    model = fresh_model(config, device)
    if lora is not None:  # adapters first: apply_strategy lays them out with their base weights
        hp.add_lora(model, lora)
    model = hp.apply_strategy(model, hp.strategy_mesh(strategy), strategy, plan_for(config))
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen weights keep no optimizer state
    # reduce_gradients resolves pending sums over dp/cp: a no-op for tp, kept as the real step has it
    return Variant(name, model, adamw(trained), before_step=hp.reduce_gradients)


def torch_tp_plan(layers: int, vocab_parallel: bool) -> dict:
    """PyTorch's hand-written Megatron plan for HF Llama's module names."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        plan.update({f"{attn}.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{mlp}.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"{attn}.o_proj"] = RowwiseParallel()
        plan[f"{mlp}.down_proj"] = RowwiseParallel()
    if vocab_parallel:  # logits stay split over the vocabulary; loss_parallel() reads them
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def torch_variant(name: str, config: LlamaConfig, device: torch.device, vocab_parallel: bool) -> Variant:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = fresh_model(config, device)
    mesh = init_device_mesh(device.type, (RANKS,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, torch_tp_plan(config.num_hidden_layers, vocab_parallel))
    params = list(model.parameters())
    # A DTensor and a plain tensor cannot meet in one optimizer op: one group each.
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    context = loss_parallel if vocab_parallel else contextlib.nullcontext
    return Variant(name, model, adamw(groups), context=context)


def unsharded_variant(config: LlamaConfig, device: torch.device) -> Variant:
    model = fresh_model(config, device)
    return Variant("unsharded", model, adamw(model.parameters()))


PHASES = ("forward", "backward", "optimizer")
Phase = Callable[[str], contextlib.AbstractContextManager]


def step(v: Variant, ids: torch.Tensor, phase: Phase = no_phase) -> torch.Tensor:
    """Forward with labels, backward, AdamW; the loss. `phase(name)` wraps each part (profiling)."""
    with phase("forward"), v.context():
        loss = v.model(input_ids=ids, labels=ids).loss
    with phase("backward"), v.context():  # loss_parallel must cover backward too
        loss.backward()
    with phase("optimizer"):
        v.before_step(v.model)
        v.optimizer.step()
        v.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def loss_value(loss: torch.Tensor) -> float:
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


# ---------------------------------------------------------------------------- tensor parallel


def run_tp(s: Settings, device: torch.device, emit: Emit) -> None:
    config = llama_config(s, s.layers, s.seq)
    ids = token_batch(s.vocab, s.batch, s.seq, device)
    # hp next to torch, torch next to torch_lp: the pairs compared run close together in time
    variants = [
        hp_variant("hp", config, device, {"tp": RANKS}),
        torch_variant("torch", config, device, vocab_parallel=False),
        torch_variant("torch_lp", config, device, vocab_parallel=True),
        hp_variant("hp_sp", config, device, {"tp": RANKS, "sp": True}),
        unsharded_variant(config, device),
        hp_variant(RECOMPUTE, config, device, {"tp": RANKS, "recompute": True}),  # last: hp runs right after it in rotated rounds
    ]
    if s.compile:
        variants.insert(4, hp_variant("hp_compile", config, device, {"tp": RANKS, "compile": True}))

    check_losses(variants, ids, emit)  # the first warm-up step, on identical weights
    for _ in range(s.warmup - 1):
        for v in variants:
            step(v, ids)
    load_before = os.getloadavg()[0]
    times = time_interleaved(variants, ids, s.reps, device)
    # Other work on the machine shows here: the run's ratios are only as good as this is low.
    emit({"bench": "machine", "cpus": os.cpu_count(), "loadavg_1min": [load_before, os.getloadavg()[0]]})
    for v in variants:
        emit({
            "bench": "tp_step", "config": v.name, "median_s": round(statistics.median(times[v.name]), 4),
            "min_s": round(min(times[v.name]), 4), "seconds": [round(t, 4) for t in times[v.name]],
            "batch": s.batch, "seq": s.seq,
        })
    # on CPU memory is counted by a dispatch mode, which compiled graphs do not run under
    memory = {v.name: peak_memory(v, ids, device) for v in variants if device.type != "cpu" or v.name != "hp_compile"}
    for name, record in memory.items():
        emit({"bench": "tp_memory", "config": name, **record})
    pair = {v.name: v for v in variants if v.name in ("hp", RECOMPUTE)}
    activations = {name: gathered(activation_peak(v.model, ids, device)) for name, v in pair.items()}
    emit(recompute_memory(memory, activations))
    profiled = [v for v in variants if v.name in ("hp", "torch", "torch_lp")]
    for name, result in profile(profiled, ids, device, rounds=3).items():
        emit({"bench": "tp_profile", "config": name, **result})
    hp_mesh = variants[0].model.lm_head.weight.device_mesh  # the tp mesh hp's variant runs on
    emit({"bench": "dispatch_us", **dispatch_costs(hp_mesh, device)})
    for record in fixed_costs(s, device):
        emit(record)


def run_lora(s: Settings, device: torch.device, emit: Emit) -> None:
    """LoRA (rank 8 on every linear of the layers) against full fine-tuning, both at tp=2 with hp.

    At LORA_BATCH x LORA_SEQ tokens, where weights, gradients and optimizer state dominate a
    rank's memory: step time (interleaved), MemTracker's peak per rank, and the bytes one rank
    sends per step (`hp.comm.trace`).
    """
    import hp

    config = llama_config(s, s.layers, LORA_SEQ)
    ids = token_batch(s.vocab, LORA_BATCH, LORA_SEQ, device)
    variants = [hp_variant("full", config, device, {"tp": RANKS}),
                hp_variant("lora", config, device, {"tp": RANKS}, lora=hp.Lora(rank=8))]
    for _ in range(s.warmup):
        for v in variants:
            step(v, ids)
    times = time_interleaved(variants, ids, s.reps, device)
    for v in variants:
        with hp.comm.trace() as trace:
            step(v, ids)
        emit({"bench": "lora_step", "config": v.name, "median_s": round(statistics.median(times[v.name]), 4),
              "comm_bytes": sum(sum(kinds.values()) for kinds in trace.per_axis().values()),
              "trained_params": sum(p.numel() for p in v.model.parameters() if p.requires_grad),
              "batch": LORA_BATCH, "seq": LORA_SEQ, **peak_memory(v, ids, device)})


def fixed_costs(s: Settings, device: torch.device, reps: int = 20) -> list[dict]:
    """hp against torch_lp on the same layers made tiny (hidden 64, 2 x 32 tokens).

    Compute nearly vanishes, so the step time is what each framework costs per step
    (Python, dispatch, collective latency): the overhead the large model hides.
    """
    tiny = replace(s, vocab=256, hidden=64, ffn=128, batch=2, seq=32)
    config = llama_config(tiny, s.layers, tiny.seq)
    ids = token_batch(tiny.vocab, tiny.batch, tiny.seq, device)
    variants = [
        hp_variant("hp", config, device, {"tp": RANKS}),
        torch_variant("torch_lp", config, device, vocab_parallel=True),
    ]
    for _ in range(3):
        for v in variants:
            step(v, ids)
    times = time_interleaved(variants, ids, reps, device)
    splits: dict[str, list[dict]] = {v.name: [] for v in variants}
    for _ in range(3):
        for v in variants:
            splits[v.name].append(time_split(v, ids, device))
    records = []
    for v in variants:
        parts = {k: round(statistics.median(x[k] for x in splits[v.name]), 5) for k in splits[v.name][0]}
        records.append({
            "bench": "tp_fixed_cost", "config": v.name, "hidden": tiny.hidden, "batch": tiny.batch,
            "seq": tiny.seq, "median_s": round(statistics.median(times[v.name]), 5),
            "min_s": round(min(times[v.name]), 5),
            **{k: parts[k] for k in ("step_compute_s", "step_collectives_s", "step_rest_s")},
        })
    return records


def recompute_memory(memory: dict[str, dict], act_peaks: dict[str, list[int]]) -> dict:
    """What recompute saves against `hp`, per rank: the step's peak bytes (`peak_memory`), and the peak
    above the model's own over forward + backward (`activation_peak`, where the step's peak may lie in
    the optimizer step instead once activations are small)."""
    plain, recomputed = memory["hp"]["peak_bytes"], memory[RECOMPUTE]["peak_bytes"]
    return {
        "bench": "recompute_memory", "peak_bytes_hp": plain, "peak_bytes_recompute": recomputed,
        "peak_saved_bytes": [a - b for a, b in zip(plain, recomputed)],
        "peak_memory_ratio": round(max(recomputed) / max(plain), 4),
        "act_peak_bytes_hp": act_peaks["hp"], "act_peak_bytes_recompute": act_peaks[RECOMPUTE],
        "act_peak_ratio": round(max(act_peaks[RECOMPUTE]) / max(act_peaks["hp"]), 4),
    }


def check_losses(variants: list[Variant], ids: torch.Tensor, emit: Emit) -> None:
    """Correctness guard: every configuration's first loss equals the unsharded one (rel 1e-5)."""
    losses = {v.name: loss_value(step(v, ids)) for v in variants}
    want = losses["unsharded"]
    for name, got in losses.items():
        rel = abs(got - want) / abs(want)
        emit({"bench": "tp_check", "config": name, "loss": got, "loss_unsharded": want, "rel_err": rel})
        if rel > 1e-5:
            raise AssertionError(f"{name}: loss {got} differs from the unsharded {want} (relative {rel:.2e})")


def time_interleaved(
    variants: list[Variant], ids: torch.Tensor, reps: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per step of each variant; each round runs every variant once, in a rotated order."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(reps):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            times[v.name].append(timed_step(v, ids, device))
    return times


def timed_step(v: Variant, ids: torch.Tensor, device: torch.device) -> float:
    """The slowest rank's wall time of one step, both ranks starting together."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    step(v, ids)
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


class _NoHook:
    """Stands in for a gradient hook MemTracker would otherwise put on a frozen parameter."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def peak_memory(v: Variant, ids: torch.Tensor, device: torch.device) -> dict:
    """Peak bytes of one step on each rank (see the module docstring for the CPU measure)."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats()
        step(v, ids)
        return {"peak_bytes": gathered(torch.accelerator.max_memory_allocated()), "measure": "max_memory_allocated"}
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(v.model, v.optimizer, ids)
    for param in v.model.parameters():
        if not param.requires_grad:  # frozen (LoRA): no gradient to hook, and MemTracker's hook would refuse them
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
    with tracker:
        step(v, ids)
    peak = tracker.get_tracker_snapshot("peak")[device]
    kinds = {str(getattr(k, "value", k)): n for k, n in peak.items() if n}
    return {"peak_bytes": gathered(peak["Total"]), "at_peak_rank0": kinds, "measure": "MemTracker"}


# ---------------------------------------------------------------------------- profile


class OpCounter(TorchDispatchMode):
    """Counts DTensor-level ops and the local ops they run, per phase of the step, and collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.dtensor_ops: Counter = Counter()  # (phase, op)
        self.local_ops: Counter = Counter()  # phase
        self.collectives: Counter = Counter()  # op

    @contextlib.contextmanager
    def during(self, name: str) -> Iterator[None]:
        self.phase = name
        yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops[self.phase, str(func)] += 1
            return NotImplemented  # DTensor desugars; its local ops come back here
        name = str(func)
        if "c10d" not in name:
            self.local_ops[self.phase] += 1
        elif "wait_tensor" not in name and "_wrap_tensor" not in name:  # bookkeeping, not traffic
            self.collectives[name.removeprefix("_c10d_functional.").removesuffix(".default")] += 1
        return func(*args, **(kwargs or {}))


def profile(variants: list[Variant], ids: torch.Tensor, device: torch.device, rounds: int) -> dict[str, dict]:
    """Where a step's time goes, per variant (rank 0's view; every rank runs the same steps).

    The time split is the median of `rounds` profiled steps, interleaved like the timing.
    """
    splits: dict[str, list[dict]] = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            splits[v.name].append(time_split(v, ids, device))
    results = {}
    for v in variants:
        result = op_counts(v, ids)
        result.update(python_time(v, ids))
        result.update({k: round(statistics.median(s[k] for s in splits[v.name]), 4) for k in splits[v.name][0]})
        results[v.name] = result
    return results


def op_counts(v: Variant, ids: torch.Tensor) -> dict:
    """DTensor-level ops and local ops per phase, collectives, of one step."""
    counter = OpCounter()
    with counter:
        step(v, ids, counter.during)
    per_phase = Counter()
    for (phase, _), n in counter.dtensor_ops.items():
        per_phase[phase] += n
    top = Counter({f"{phase} {op}": n for (phase, op), n in counter.dtensor_ops.items()})
    return {
        "dtensor_ops": {p: per_phase[p] for p in PHASES},
        "local_ops": {p: counter.local_ops[p] for p in PHASES},
        "collectives": dict(counter.collectives),
        "top_dtensor_ops": dict(top.most_common(10)),
    }


def python_time(v: Variant, ids: torch.Tensor) -> dict:
    """cProfile of one step: self time per package, and DTensor's propagation/redistribution counts."""
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    step(v, ids)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, ncalls, tottime, cumtime, callers)
    by_package: Counter = Counter()
    by_function: Counter = Counter()
    calls: Counter = Counter()
    for (filename, line, function), (_, ncalls, tottime, _, _) in stats.items():
        by_package[bucket(filename)] += tottime
        if filename != "~":
            by_function[f"{short(filename)}:{line} {function} x{ncalls}"] += tottime
        if filename.endswith("_redistribute.py") and function == "redistribute_local_tensor":
            calls["redistribute_local_tensor"] += ncalls
        elif filename.endswith("_sharding_prop.py") and function in ("propagate", "propagate_op_sharding_non_cached"):
            calls[function] += ncalls
        elif filename.endswith("region.py") and function in ("__torch_function__", "_replicated"):
            calls[f"hp_region{function}"] += ncalls
        elif filename.endswith("tensor/_api.py") and function in ("from_local", "to_local"):
            calls[function] += ncalls
    hp_functions = [(k, t) for k, t in by_function.most_common() if k.startswith("hp/")][:10]
    return {
        "cprofile_self_s": {k: round(t, 4) for k, t in by_package.most_common()},
        "cprofile_top_python_self_s": {k: round(t, 4) for k, t in by_function.most_common(12)},
        "cprofile_top_hp_self_s": {k: round(t, 4) for k, t in hp_functions},
        "cprofile_calls": sum(n for _, n, *_ in stats.values()),
        "redistributes": calls["redistribute_local_tensor"],
        "sharding_propagations": calls["propagate"],
        "sharding_cache_misses": calls["propagate_op_sharding_non_cached"],
        "hp_region_calls": calls["hp_region__torch_function__"],
        "hp_region_wraps_plain": calls["hp_region_replicated"],  # calls that mixed in plain tensors
        "dtensor_from_local": calls["from_local"],
        "dtensor_to_local": calls["to_local"],
    }


def dispatch_costs(mesh: DeviceMesh, device: torch.device, calls: int = 2000) -> dict:
    """Microseconds per elementwise op on a tiny tensor: the fixed cost of each way to run it.

    Plain; a replicated DTensor (DTensor's dispatch); the same inside `hp.region()` (plus hp's
    torch-function layer); and a DTensor meeting a plain tensor there (which hp wraps).
    """
    from torch.distributed.tensor import Replicate

    import hp

    plain = torch.randn(8, 8, device=device)
    replicated = DTensor.from_local(plain, mesh, [Replicate()] * mesh.ndim, run_check=False)

    def per_call(fn: Callable[[], object]) -> float:
        for _ in range(100):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return round((time.perf_counter() - start) / calls * 1e6, 2)

    costs = {"plain": per_call(lambda: plain * plain), "dtensor": per_call(lambda: replicated * replicated)}
    with hp.region():
        costs["dtensor_in_region"] = per_call(lambda: replicated * replicated)
        costs["dtensor_with_plain_in_region"] = per_call(lambda: replicated * plain)
    return costs


def _is_comm(name: str) -> bool:
    return any(k in name for k in ("c10d", "gloo", "nccl", "hccl", "wait_tensor", "record_param_comms"))


def time_split(v: Variant, ids: torch.Tensor, device: torch.device) -> dict:
    """torch.profiler of one step: per phase, wall = compute + collectives + the rest.

    Compute is the time of aten ops on local tensors (that dispatch no DTensor below them).
    """
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    dist.barrier()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        # each phase an event on the step's own thread: gloo's threads stay out
        step(v, ids, record_function)
        _sync(device)
    events = prof.profiler.function_events
    wraps: dict[int, bool] = {}

    def wraps_more(e) -> bool:
        """Whether `e` dispatched a tensor subclass (DTensor) or a collective somewhere below."""
        if id(e) not in wraps:
            wraps[id(e)] = any(
                c.name == "PythonSubclass" or _is_comm(c.name) or wraps_more(c) for c in e.cpu_children
            )
        return wraps[id(e)]

    def split(e, into: Counter) -> None:
        if _is_comm(e.name):
            into["collectives"] += e.time_range.elapsed_us()
        elif e.name.startswith("aten::") and not wraps_more(e):
            into["compute"] += e.time_range.elapsed_us()  # an op on plain (local) tensors, whole
        else:  # a DTensor-level op, an autograd node, ...: its children's time plus overhead
            for c in e.cpu_children:
                split(c, into)

    out = {}
    for phase in PHASES:
        root = next(e for e in events if e.name == phase and e.cpu_parent is None)
        parts: Counter = Counter()
        for e in root.cpu_children:
            split(e, parts)
        wall = root.time_range.elapsed_us()
        parts["rest"] = wall - parts["compute"] - parts["collectives"]
        out[f"{phase}_wall_s"] = wall / 1e6
        out.update({f"{phase}_{k}_s": parts[k] / 1e6 for k in ("compute", "collectives", "rest")})
    for k in ("wall", "compute", "collectives", "rest"):
        out[f"step_{k}_s"] = sum(out[f"{p}_{k}_s"] for p in PHASES)
    return out


# ---------------------------------------------------------------------------- context parallel


def run_cp(s: Settings, device: torch.device, emit: Emit) -> None:
    from hp.models import plan_for

    import hp

    config = llama_config(s, s.cp_layers, max(s.cp_seqs))
    strategy = {"cp": RANKS, "cp_algorithm": s.cp_algorithm}
    plain = fresh_model(config, device)
    split = hp.apply_strategy(fresh_model(config, device), hp.strategy_mesh(strategy), strategy, plan_for(config))
    for seq in s.cp_seqs:
        ids = token_batch(s.vocab, s.cp_batch, seq, device)
        losses = {}
        for cp, model in ((1, plain), (RANKS, split)):
            saved, attn, loss = saved_activation_bytes(model, ids)
            losses[cp] = loss
            record = {
                "bench": "cp_memory", "cp": cp, "seq": seq, "batch": s.cp_batch, "layers": s.cp_layers,
                "cp_algorithm": s.cp_algorithm if cp > 1 else None,
                "saved_bytes": gathered(saved), "attn_saved_bytes": gathered(attn),
                "act_peak_bytes": gathered(activation_peak(model, ids, device)),
            }
            if cp > 1:
                record["loss_rel_err"] = abs(loss - losses[1]) / abs(losses[1])
            emit(record)
        rel = abs(losses[RANKS] - losses[1]) / abs(losses[1])
        if rel > 1e-4:  # ring attention sums in another order than one device: a looser bound
            raise AssertionError(f"cp={RANKS} ({s.cp_algorithm}) seq {seq}: loss off by {rel:.2e}")


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_activation_bytes(model: nn.Module, ids: torch.Tensor) -> tuple[int, int, float]:
    """(bytes saved for backward by the forward, by the attention blocks, the loss), this rank.

    Distinct storages, parameters and buffers excluded: what the forward keeps alive for backward.
    """
    weights = {_storage(p).data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[int, bool]] = {}
    inside = [0]  # depth of attention blocks being run

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        ptr = storage.data_ptr()
        if ptr not in weights and ptr not in seen:
            seen[ptr] = (storage.nbytes(), inside[0] > 0)
        return t

    def enter(module: nn.Module, args: tuple) -> None:
        inside[0] += 1

    def leave(module: nn.Module, args: tuple, out: object) -> None:
        inside[0] -= 1

    hooks = []
    for layer in model.model.layers:
        hooks += [layer.self_attn.register_forward_pre_hook(enter), layer.self_attn.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        for h in hooks:
            h.remove()
    value = loss_value(loss.detach())
    del loss  # frees the graph and what it saved
    total = sum(n for n, _ in seen.values())
    attn = sum(n for n, in_attn in seen.values() if in_attn)
    return total, attn, value


def activation_peak(model: nn.Module, ids: torch.Tensor, device: torch.device) -> int:
    """Peak bytes above the model's own over forward + backward, this rank."""
    model.zero_grad(set_to_none=True)
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats()
        base = torch.accelerator.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        peak = torch.accelerator.max_memory_allocated() - base
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, ids)
        with tracker:
            base = tracker.get_tracker_snapshot("current")[device]["Total"]
            model(input_ids=ids, labels=ids).loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[device]["Total"] - base
    model.zero_grad(set_to_none=True)
    return peak


if __name__ == "__main__":
    main()

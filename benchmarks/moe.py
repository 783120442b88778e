"""Expert parallel on a Qwen3-MoE: hp's all-to-all bytes against the routing, and a step against HF's own EP.

Why: hp's expert parallel (`hp.ops.expert_parallel`) sends every routed
(token, k) row to the rank of its expert and back, nothing dropped and
nothing padded, so what it sends is fixed by the routing alone; this checks
that the bytes it moves are exactly those, and measures what its training
step costs against Hugging Face's own expert parallel, which runs the same
algorithm (DeepSpeed-MoE's and torchtitan's count exchange, dispatch,
combine), and against the plain model.

One HF `Qwen3MoeForCausalLM` (hidden 256, 4 layers, 8 experts of width 256,
top-2, 8 query / 4 KV heads of dim 32, vocabulary 2048; fp32), batch 4 x
512 tokens per rank, takes a step (forward with labels, backward, AdamW) on
2 real gloo ranks launched from this script, as

- `hp`: `hp.Strategy(dp=2, ep=2)` with `hp.strategy_mesh` + `hp.apply_strategy`
  and the Qwen-MoE plan: one mesh axis `ep`, the batch split `b/ep`, the
  experts `e/ep`, every other parameter replicated; `hp.reduce_gradients`
  before the optimizer (the replicated parameters' gradients summed in one
  flat all-reduce);
- `hp_fsdp`: the same with `fsdp=True`: the dense parameters FSDP-sharded
  over both ranks, the experts not (each rank holds its experts whole),
  which is how HF's EP lays the model out;
- `hf_ep`: `AutoModelForCausalLM.from_pretrained(dir, distributed_config=
  DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"))`
  from a directory where rank 0 saved the same model (transformers 5's
  `transformers.distributed`). HF's EP needs `ep_size` to divide `fsdp_size
  x tp_size`: with tp_size=2 the two ranks would share one batch (its
  all-to-all then slices it), so the batch split like hp's `b/ep` needs
  fsdp_size=2, and HF's EP then always comes with FSDP2 on the dense
  modules (efsdp = 1: experts whole on their rank, `grouped_gemm` style,
  `ep_dispatch_experts` with `AllToAllEP`: counts by `dist.all_to_all_single`,
  rows by `all_to_all_single_autograd`). Each rank feeds its own half of
  the batch; the experts run HF's `grouped_mm` implementation, as in hp's
  configurations (the experts module's own code on each rank's rows);
- `unsharded`: the plain model on each rank, on the whole batch (8 x 512).

The first warm-up step of every configuration starts from the same weights;
its loss must equal the unsharded loss on the whole batch to 1e-5 (relative)
or the run stops. hp's loss is one mean over the split batch; HF's ranks
each return the mean over their half, and since every row has the same
number of labels (no padding), the mean of the two is the whole batch's.
Timed steps then run interleaved (the order rotates each round), so machine
noise hits every configuration alike; a step's time is the slowest rank's,
between barriers, and each configuration reports its median (the summary's
ratios are median over median), its minimum, and the median of each phase
(forward, backward, `reduce` = `hp.reduce_gradients`, optimizer), slowest rank.
Only ratios within one run mean anything on a shared machine.

All-to-all bytes: one more step of `hp`, under `hp.comm.trace()` (its
all_to_all records on axis `ep`, forward and backward, which count an
uneven all-to-all as the rows sent to other ranks times the row's bytes),
with forward hooks on every router (`mlp.gate`, whose output carries each
token's top-k expert ids). The routers' ids give each rank's rows per
expert per layer; the ranks exchange these counts, and the formula follows
from them alone, per rank r and layer, with E/ep experts per rank and rows
of hidden x 4 bytes: the count exchange (E/ep int64 counts to each other
rank: (ep - 1) x E/ep x 8 bytes), the dispatch (r's rows for experts on
other ranks), the combine (the rows r's experts received from the other
ranks, sent back), and in backward the reverse of both (the combine's
gradients go back as r's dispatched rows, the dispatch's as the rows r
received). The count exchange is in both figures. `a2a_bytes_match` is true
only if the trace and the formula agree exactly on every rank, and the
trace saw 3 all-to-alls per layer in forward and 2 in backward.

Peak memory per rank: `torch.distributed._tools.mem_tracker.MemTracker`, a
dispatch mode that tracks the storage of every local tensor an op returns
(plus parameters, gradients, optimizer states) and adds its bytes while
alive; the peak of that sum over one step after warm-up. Tensor storage
only (no allocator caching, kernel scratch or gloo buffers), so exact and
deterministic, unlike RSS.

Profile (rank 0, one step each): the collectives by phase, kind and axis
(`hp.comm.trace`, which also sees HF's and FSDP2's), the DTensor-level ops
per phase (each a DTensor dispatch in Python), and cProfile's self time
per package (C++ reached through pybind, such as a blocking gloo
collective, counts as its Python caller's) and the top functions.

If HF's EP cannot be built here, a record says why, its ratios are null
and the rest still runs. Prints one JSON object per measurement and a
summary object last, nothing after it; about two and a half minutes on 2
shared CPU cores. 512 tokens a row keep a step's compute well above hp's
fixed cost of dispatching DTensor ops on the dense layers (a few hundredths
of a second a step here, the forward's gap to HF's at any length), which a shorter
sequence would mostly measure instead.

    python benchmarks/moe.py [--reps 9]
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
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

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

RANKS = 2  # ep degree (= dp: ep splits the data-parallel ranks), and the number of processes launched
HF = "hf_ep"
PHASES = ("forward", "backward", "reduce", "optimizer")  # reduce: hp.reduce_gradients (hp only)
Phase = Callable[[str], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class Settings:
    """Shapes and repetitions of one run (printed in the summary)."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    moe_ffn: int = 256  # each expert's width; a multiple of 8, as torch._grouped_mm needs on CPU
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    batch: int = 4  # per rank: the whole batch is RANKS x this
    seq: int = 512  # tokens per row: compute well above hp's fixed dispatch cost
    warmup: int = 2
    reps: int = 9


def parse_args(argv: list[str] | None = None) -> tuple[Settings, str | None, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, help="timed steps per configuration")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    settings = Settings() if args.reps is None else Settings(reps=args.reps)
    return settings, args.model_dir, args.worker


# ---------------------------------------------------------------------------- launcher


def main() -> None:
    settings, model_dir, is_worker = parse_args()
    if is_worker:
        worker(settings, model_dir)
    else:
        launch(settings, sys.argv[1:])


def launch(settings: Settings, argv: list[str]) -> None:
    """Run this script on RANKS gloo workers; relay their JSON lines; print the summary last."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hp_moe_") as model_dir:  # where HF's EP loads the model from
        quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                 "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error")}
        records, code = run_ranks(__file__, RANKS, [*argv, "--model-dir", model_dir], "moe", env=quiet)
    summary = summarize(records, settings)
    summary["launch_exit_code"] = code
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


def _ratio(medians: dict[str, float], mine: str, theirs: str) -> float | None:
    return round(medians[mine] / medians[theirs], 4) if theirs in medians else None


def _paired(steps: dict[str, dict], mine: str, theirs: str) -> float | None:
    """The median over rounds of (my step time / theirs in the same round)."""
    if theirs not in steps:
        return None
    pairs = zip(steps[mine]["seconds"], steps[theirs]["seconds"])
    return round(statistics.median(a / b for a, b in pairs), 4)


def summarize(records: list[dict], settings: Settings) -> dict:
    """The last line: the byte check, the step ratios, memory, and the inputs."""
    steps = {r["config"]: r for r in records if r["bench"] == "moe_step"}
    medians = {name: r["median_s"] for name, r in steps.items()}
    a2a = next(r for r in records if r["bench"] == "a2a_bytes")
    hf = next(r for r in records if r["bench"] == "hf_ep")
    summary = {
        "summary": True,
        "a2a_bytes_match": a2a["match"],
        "step_ratio_vs_hf": _ratio(medians, "hp", HF),
        "step_ratio_vs_unsharded": _ratio(medians, "hp", "unsharded"),
        "step_ratio_fsdp_vs_hf": _ratio(medians, "hp_fsdp", HF),  # the like-for-like layout
        "hf_ratio_vs_unsharded": _ratio(medians, HF, "unsharded"),
        # noise-robust companions: fastest step over fastest step, and the median of same-round ratios
        "step_ratio_vs_hf_min": round(steps["hp"]["min_s"] / steps[HF]["min_s"], 4) if HF in steps else None,
        "step_ratio_vs_hf_paired": _paired(steps, "hp", HF),
        "first_loss_rel_err": {r["config"]: r["rel_err"][0] for r in records if r["bench"] == "moe_check"},
        "hp_a2a_bytes_per_step": a2a["trace_bytes"],
        "formula_a2a_bytes_per_step": a2a["formula_bytes"],
        "a2a_bytes_include_count_exchange": True,
        "median_s": medians,
        "phase_median_s": {name: r["phase_median_s"] for name, r in steps.items()},
        "peak_memory_bytes": {r["config"]: r["peak_bytes"] for r in records if r["bench"] == "moe_memory"},
        "hf_ep": "ran" if hf["ran"] else hf["error"],
        "loadavg_1min_during_timing": next(r["loadavg_1min"] for r in records if r["bench"] == "machine"),
    }
    summary["target_met"] = summary["a2a_bytes_match"] and (summary["step_ratio_vs_hf"] or float("inf")) <= 1.0
    summary["inputs"] = {**asdict(settings), "ranks": RANKS, "dtype": "float32"}
    return summary


# ---------------------------------------------------------------------------- workers


def worker(s: Settings, model_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    import transformers  # here, not at the top: the launching process needs neither transformers nor hp

    emit = emitter(rank)
    emit({"bench": "setup", "torch": torch.__version__, "transformers": transformers.__version__})
    config = moe_config(s)
    ids = token_batch(s)
    variants = [hp_variant("hp", config, ids, {"dp": RANKS, "ep": RANKS})]  # its mesh starts the gloo world
    hf = hf_variant(config, ids, model_dir)
    emit({"bench": "hf_ep", "ran": isinstance(hf, Variant), "error": None if isinstance(hf, Variant) else hf})
    if isinstance(hf, Variant):
        variants.append(hf)
    variants += [hp_variant("hp_fsdp", config, ids, {"dp": RANKS, "ep": RANKS, "fsdp": True}),
                 unsharded_variant(config, ids)]
    emit({"bench": "experts_implementation", **{v.name: v.model.config._experts_implementation for v in variants}})

    check_losses(variants, s.warmup, emit)  # the warm-up steps, from identical weights
    load_before = os.getloadavg()[0]
    times = time_interleaved(variants, s.reps)
    # Other work on the machine shows here: the run's ratios are only as good as this is low.
    emit({"bench": "machine", "cpus": os.cpu_count(), "loadavg_1min": [load_before, os.getloadavg()[0]]})
    for v in variants:
        emit(step_record(v, times[v.name], s))
    emit(a2a_bytes(variants[0], s))
    for v in variants:
        emit({"bench": "moe_memory", "config": v.name, **peak_memory(v)})
    for v in variants:
        if v.name != "unsharded":
            emit({"bench": "moe_profile", "config": v.name, **collectives(v), **dtensor_ops(v), **python_time(v)})
    dist.barrier()  # every rank is past its last collective
    emit({DONE: True})


# ---------------------------------------------------------------------------- models


def moe_config(s: Settings):
    from hp.models import tiny_config

    return tiny_config(
        "qwen3_moe", layers=s.layers, vocab_size=s.vocab, hidden_size=s.hidden, num_experts=s.experts,
        num_experts_per_tok=s.top_k, moe_intermediate_size=s.moe_ffn, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, max_position_embeddings=s.seq,
    )


def fresh_model(config) -> nn.Module:
    """The same initial weights on every rank and for every configuration (seeded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def token_batch(s: Settings) -> torch.Tensor:
    """The whole batch (RANKS x batch rows), equal on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, s.vocab, (RANKS * s.batch, s.seq), generator=gen)


@dataclass
class Variant:
    """One configuration: a model, its optimizer, the ids this rank feeds it, and its step's extras."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ids: torch.Tensor
    before_step: Callable[[nn.Module], None] = lambda model: None
    loss_of: Callable[[torch.Tensor], float] = lambda loss: loss.item()
    phase_seconds: list[dict[str, float]] = field(default_factory=list)


def hp_variant(name: str, config, ids: torch.Tensor, strategy: dict) -> Variant:
    """hp's layout: each rank feeds the whole batch, which the `b/ep` input layout splits."""
    from hp.models import plan_for

    import hp

    model = hp.apply_strategy(fresh_model(config), hp.strategy_mesh(strategy), strategy, plan_for(config))
    return Variant(name, model, adamw(model.parameters()), ids, before_step=hp.reduce_gradients,
                   loss_of=lambda loss: loss.full_tensor().item())


def hf_variant(config, ids: torch.Tensor, model_dir: str) -> Variant | str:
    """HF's own expert parallel on the same weights, or why it cannot run here."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    if dist.get_rank() == 0:
        fresh_model(config).save_pretrained(model_dir)
    dist.barrier()
    try:
        distributed = DistributedConfig(fsdp_size=RANKS, ep_size=RANKS, ep_implementation="all_to_all")
        model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=distributed).train()
    except Exception as e:  # noqa: BLE001  reported in the JSON; the rest of the benchmark still runs
        return f"{type(e).__name__}: {e}"
    own = ids.chunk(RANKS)[dist.get_rank()]  # each rank its own half of the batch
    return Variant(HF, model, adamw(model.parameters()), own, loss_of=_mean_over_ranks)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The whole batch's mean loss from each rank's mean over its half (equal label counts)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def unsharded_variant(config, ids: torch.Tensor) -> Variant:
    model = fresh_model(config)
    return Variant("unsharded", model, adamw(model.parameters()), ids)


def step(v: Variant, phase: Phase = no_phase) -> torch.Tensor:
    """Forward with labels, backward, AdamW; the loss. `phase(name)` wraps each part."""
    with phase("forward"):
        loss = v.model(input_ids=v.ids, labels=v.ids).loss
    with phase("backward"):
        loss.backward()
    with phase("reduce"):
        v.before_step(v.model)
    with phase("optimizer"):
        v.optimizer.step()
        v.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def check_losses(variants: list[Variant], warmup: int, emit: Emit) -> None:
    """Correctness guard: every configuration's first loss equals the unsharded one (rel 1e-5).

    The later warm-up steps' losses (after an update through each one's gradients) are reported.
    """
    losses = {v.name: [] for v in variants}
    for _ in range(warmup):
        for v in variants:
            losses[v.name].append(v.loss_of(step(v)))
    want = losses["unsharded"]
    for name, got in losses.items():
        rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
        emit({"bench": "moe_check", "config": name, "losses": got, "losses_unsharded": want, "rel_err": rel})
        if rel[0] > 1e-5:
            raise AssertionError(f"{name}: loss {got[0]} differs from the unsharded {want[0]} (relative {rel[0]:.2e})")


# ---------------------------------------------------------------------------- step time


def time_interleaved(variants: list[Variant], reps: int) -> dict[str, list[float]]:
    """Seconds per step of each variant; each round runs every variant once, in a rotated order."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(reps):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            times[v.name].append(timed_step(v))
    return times


def timed_step(v: Variant) -> float:
    """The slowest rank's wall time of one step, both ranks starting together; its phases kept on `v`."""
    phases: dict[str, float] = {}

    @contextlib.contextmanager
    def stopwatch(name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        phases[name] = time.perf_counter() - start

    dist.barrier()
    start = time.perf_counter()
    step(v, stopwatch)
    elapsed = torch.tensor([time.perf_counter() - start, *(phases[p] for p in PHASES)], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    v.phase_seconds.append(dict(zip(PHASES, elapsed[1:].tolist())))
    return elapsed[0].item()


def step_record(v: Variant, seconds: list[float], s: Settings) -> dict:
    """Step times of `v`, and the median of each phase over its timed steps (slowest rank each)."""
    timed = v.phase_seconds[-len(seconds):]
    return {
        "bench": "moe_step", "config": v.name, "median_s": round(statistics.median(seconds), 4),
        "min_s": round(min(seconds), 4), "seconds": [round(t, 4) for t in seconds],
        "phase_median_s": {p: round(statistics.median(x[p] for x in timed), 4) for p in PHASES},
        "tokens_per_rank": v.ids.numel() if v.name == "unsharded" else s.batch * s.seq,
    }


# ---------------------------------------------------------------------------- all-to-all bytes


def routed_counts(model: nn.Module, run: Callable[[], object], experts: int) -> torch.Tensor:
    """[layers, experts]: this rank's (token, k) rows per expert in each MoE layer during `run()`.

    Read from the routers' own output (`mlp.gate` returns logits, weights and top-k ids), so the
    count owes nothing to the expert-parallel code that sends the rows.
    """
    counts: list[torch.Tensor] = []

    def count(module: nn.Module, args: tuple, out: tuple) -> None:
        ids = out[2].to_local() if isinstance(out[2], DTensor) else out[2]
        counts.append(torch.bincount(ids.detach().reshape(-1), minlength=experts))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(counts)


def formula_bytes(counts: torch.Tensor, hidden: int, dtype_bytes: int = 4) -> list[dict[str, int]]:
    """Bytes each rank sends in the all-to-alls of one forward + backward, from the routing alone.

    `counts[s, l, e]`: rank s's rows for expert e in layer l; rank r holds experts
    [r E/ep, (r + 1) E/ep). Per layer, rank r sends in forward the count exchange (E/ep int64
    counts to each other rank), the dispatch (its rows for other ranks' experts) and the combine
    (the rows its experts got from the other ranks, back); in backward the combine's reverse
    (the gradients of its dispatched rows) and the dispatch's reverse (those of the rows it got).

    >>> c = torch.tensor([[[3, 1, 0, 2]], [[1, 0, 4, 0]]])  # 2 ranks, 1 layer, 4 experts
    >>> formula_bytes(c, hidden=2, dtype_bytes=1)[0]
    {'count_exchange': 16, 'dispatch': 4, 'combine': 2, 'combine_grad': 4, 'dispatch_grad': 2, 'total': 28}
    """
    ranks, layers, experts = counts.shape
    local = experts // ranks
    owner = torch.arange(experts) // local
    row = hidden * dtype_bytes
    out = []
    for r in range(ranks):
        others = [s for s in range(ranks) if s != r]
        dispatch = int(counts[r][:, owner != r].sum()) * row
        combine = int(counts[others][:, :, owner == r].sum()) * row
        parts = {
            "count_exchange": layers * (ranks - 1) * local * 8,
            "dispatch": dispatch,
            "combine": combine,
            "combine_grad": dispatch,
            "dispatch_grad": combine,
        }
        out.append({**parts, "total": sum(parts.values())})
    return out


def a2a_bytes(v: Variant, s: Settings) -> dict:
    """hp's all-to-all bytes in one step (`hp.comm.trace`) against `formula_bytes` of its routing."""
    import hp

    with hp.comm.trace() as trace:
        counts = routed_counts(v.model, lambda: step(v), s.experts)
    everyone = torch.stack(gathered(counts))  # [ranks, layers, experts]
    formula = formula_bytes(everyone, s.hidden)
    traced = gathered({
        "bytes": trace.bytes("all_to_all", axis="ep"),
        "forward": trace.count("all_to_all", axis="ep", phase="forward"),
        "backward": trace.count("all_to_all", axis="ep", phase="backward"),
        "other_kinds_on_ep": sorted({r.kind for r in trace.select(axis="ep")} - {"all_to_all"}),
    })
    counts_ok = all(t["forward"] == 3 * s.layers and t["backward"] == 2 * s.layers for t in traced)
    bytes_ok = all(t["bytes"] == f["total"] for t, f in zip(traced, formula))
    return {
        "bench": "a2a_bytes", "config": v.name, "match": counts_ok and bytes_ok,
        "trace_bytes": [t["bytes"] for t in traced], "formula_bytes": [f["total"] for f in formula],
        "formula_parts": formula, "trace_all_to_alls": [{k: t[k] for k in ("forward", "backward")} for t in traced],
        "other_kinds_on_ep": traced[0]["other_kinds_on_ep"],
        "rows_per_expert": everyone.sum(1).tolist(),  # [rank][expert], summed over layers
    }


# ---------------------------------------------------------------------------- memory


def peak_memory(v: Variant) -> dict:
    """Peak bytes of one step on each rank (see the module docstring for the measure)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(v.model, v.optimizer, v.ids)
    with tracker:
        step(v)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    kinds = {str(getattr(k, "value", k)): n for k, n in peak.items() if n}
    return {"peak_bytes": gathered(peak["Total"]), "at_peak_rank0": kinds, "measure": "MemTracker"}


# ---------------------------------------------------------------------------- profile


class OpCounter(TorchDispatchMode):
    """Counts DTensor-level ops per phase of the step (each one a DTensor dispatch in Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.dtensor_ops: Counter = Counter()

    @contextlib.contextmanager
    def during(self, name: str) -> Iterator[None]:
        self.phase = name
        yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops[self.phase] += 1
            return NotImplemented  # DTensor desugars; its local ops come back here
        return func(*args, **(kwargs or {}))


def dtensor_ops(v: Variant) -> dict:
    """DTensor-level ops per phase of one step."""
    counter = OpCounter()
    with counter:
        step(v, counter.during)
    return {"dtensor_ops": {p: counter.dtensor_ops[p] for p in PHASES}}


def collectives(v: Variant) -> dict:
    """The collectives of one step: {"phase kind axis": [count, bytes this rank sends]}."""
    import hp

    with hp.comm.trace() as trace:
        step(v)
    table: dict[str, list[int]] = {}
    for r in trace.records:
        entry = table.setdefault(f"{r.phase} {r.kind} {r.axis}", [0, 0])
        entry[0] += 1
        entry[1] += r.bytes
    return {"collectives": table}


# what a step's Python does per op: (file suffix, functions) whose calls the profile counts
COUNTED = {
    "redistributes": ("_redistribute.py", ("redistribute_local_tensor",)),
    "hp_region_ops": ("hp/region.py", ("__torch_function__",)),  # torch calls hp's region sees
}


def python_time(v: Variant) -> dict:
    """cProfile of one step (rank 0): self time per package and the top functions."""
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    step(v)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, ncalls, tottime, cumtime, callers)
    by_package: Counter = Counter()
    by_function: Counter = Counter()
    calls: Counter = Counter()
    for (filename, line, function), (_, ncalls, tottime, _, _) in stats.items():
        by_package[bucket(filename)] += tottime
        name = function if filename == "~" else f"{short(filename)}:{line} {function}"
        by_function[f"{name} x{ncalls}"] += tottime
        for counted, (suffix, functions) in COUNTED.items():
            if filename.endswith(suffix) and function in functions:
                calls[counted] += ncalls
    hp_functions = [(k, t) for k, t in by_function.most_common() if k.startswith("hp/")][:8]
    return {
        "cprofile_s": round(sum(by_package.values()), 4),
        "cprofile_self_s": {k: round(t, 4) for k, t in by_package.most_common()},
        "cprofile_top_self_s": {k: round(t, 4) for k, t in by_function.most_common(12)},
        "cprofile_top_hp_self_s": {k: round(t, 4) for k, t in hp_functions},
        "calls": {k: calls[k] for k in COUNTED},
    }


if __name__ == "__main__":
    main()

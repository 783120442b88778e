"""hp's host overhead: a Llama step under hp against plain PyTorch and PyTorch's own tensor parallel.

Why: on accelerators a step of a laid-out model is bound by host-side
dispatch (Python, DTensor's sharding propagation, autograd bookkeeping)
long before communication; this measures that cost where kernels cost
little, so that it shows alone, and at a size where kernels matter.

Two HF `LlamaForCausalLM` models (fp32, forward with labels, backward and
AdamW's multi-tensor step, as on accelerators; the same weights for every
configuration):

- `tiny`: hidden 64, 4 layers, ffn 176, 4 heads / 2 KV heads, vocabulary 256,
  batch 2 x 64 tokens: kernels cost almost nothing, a step is its overhead;
- `512`: hidden 512, 4 layers, ffn 1376, 8 heads / 4 KV heads, vocabulary
  4096, batch 4 x 256 tokens (the model of `benchmarks/llama_step.py`).

Each runs on one rank and on 2 gloo ranks (the script launches both worlds
with torchrun, one thread per rank), as

- `plain`: the model itself on each rank (whole batch);
- `torch`: `parallelize_module` with ColwiseParallel on q/k/v/gate/up and
  RowwiseParallel on o/down, on a 1-D mesh of all ranks;
- `hp`: `hp.apply_strategy` with the Llama plan at `tp=2` on `hp.mesh(tp=N)`,
  N the ranks: the Megatron layouts, vocab-parallel LM head and loss (on one
  rank the tp axis has size 1: everything is laid out, nothing moves);
- `hp_compiled`: `hp` with `compile=True`: each decoder layer and the loss
  under `torch.compile(fullgraph=True)`, inductor's kernels (`hp.compile_blocks`,
  `hp.compile_loss`);
  when that cannot compile, a record says why and the figures are null;
- `hp_recompute`, `hp_compiled_recompute`: the same two with `recompute=True`
  (each block's activations recomputed in backward; compiled, the block's
  graph runs again under an eager checkpoint).

Then a tiny Qwen3-MoE and a tiny Qwen2.5-VL (2 layers; `hp.models.tiny_config`;
batch 4 x 64 tokens, the VL batch with its images), laid out at tp=2 with
recompute as `hp train` runs them, eager (`hp_recompute`) and compiled
(`hp_compiled_recompute`: the MoE's experts, split over tp, stay eager and
each block compiles around them; the VL decoder's blocks compile, its
vision tower stays eager).

The first step of each configuration must give the plain model's loss
(the eager one's, for the MoE and VL models)
(relative 1e-5). Then steps run interleaved, the order rotating each round;
a step's time is the slowest rank's between barriers; each configuration
reports its median, and a ratio of two configurations is the median over
rounds of their same-round ratio (a slow spell of this shared machine slows
both). `host_ms_per_layer` = (median - plain's median) / layers:
what the configuration adds per decoder layer per step. Recompiles: dynamo's
count of compiled frames after the timed steps minus after warm-up.

Summary (last line): `host_ratio_vs_torch` = hp / torch, tiny, one rank;
`compiled_vs_eager` = hp_compiled / hp, 512, 2 ranks; `compiled_vs_eager_recompute`
= hp_compiled_recompute / hp_recompute, the same; `moe_compiled_vs_eager_recompute` and
`vl_compiled_vs_eager_recompute`, the same for the MoE and VL steps on 2 ranks;
`moe_vl_recompiles_after_warmup` (theirs) and `recompiles_after_warmup` (the most of
any compiled configuration). About twelve minutes on 2 CPU cores.

    python benchmarks/overhead.py [--reps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from llama_step import torch_tp_plan
from ranks import DONE, emitter, run_ranks

MODELS = {
    "tiny": dict(vocab=256, hidden=64, ffn=176, layers=4, heads=4, kv_heads=2, batch=2, seq=64),
    "512": dict(vocab=4096, hidden=512, ffn=1376, layers=4, heads=8, kv_heads=4, batch=4, seq=256),
}
REPS = {"tiny": 81, "512": 25}
FAMILIES = ("qwen3_moe", "qwen2_5_vl")  # tiny steps of the MoE and vision-language plans, eager and compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, help="timed steps per configuration and model")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args()
    if args.worker:
        worker(args.reps)
        return
    started, records = time.perf_counter(), []
    for ranks in (1, 2):
        records += launch(ranks, sys.argv[1:])
    summary = summarize(records)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


def launch(ranks: int, argv: list[str]) -> list[dict]:
    return run_ranks(__file__, ranks, argv, "overhead")[0]


def worker(reps: int | None) -> None:
    torch.set_num_threads(1)
    import hp

    emit = emitter(int(os.environ["RANK"]))
    mesh = hp.mesh(tp=int(os.environ["WORLD_SIZE"]))
    for name, shape in MODELS.items():
        measure(name, shape, mesh, reps or REPS[name], emit)
    for family in FAMILIES:
        measure_family(family, mesh, reps or REPS["tiny"], emit)
    dist.barrier()
    emit({DONE: True})


def measure(name: str, shape: dict, mesh, reps: int, emit) -> None:
    import hp
    from hp.models import plan_for
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq"], use_cache=False,
    )
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    # each model compiles as its own job would: after another model's blocks, dynamo would
    # take the new shapes for a varying length and compile them symbolic
    torch._dynamo.reset()

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    def laid_out(compile: bool, recompute: bool = False):
        return hp.apply_strategy(fresh(), mesh, {"tp": 2, "compile": compile, "recompute": recompute},
                                 plan_for(config))

    plain, torch_tp = fresh(), fresh()
    parallelize_module(torch_tp, mesh, torch_tp_plan(shape["layers"], vocab_parallel=False))
    variants = {"plain": plain, "torch": torch_tp, "hp": laid_out(False), "hp_compiled": laid_out(True),
                "hp_recompute": laid_out(False, True), "hp_compiled_recompute": laid_out(True, True)}
    compare(name, variants, {"input_ids": ids, "labels": ids}, reps, emit, per_layer=shape["layers"])


def measure_family(family: str, mesh, reps: int, emit) -> None:
    """A tiny MoE or vision-language step laid out at tp=2 with recompute (hp train's default), eager
    and compiled: the MoE's experts, split over tp, stay eager and the block compiles around them;
    the VL model's decoder blocks compile, its vision tower runs eagerly."""
    import hp
    from hp.models import plan_for, tiny_config, tiny_vl_batch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch._dynamo.reset()
    config = tiny_config(family, layers=2)
    auto = AutoModelForImageTextToText if "_vl" in family else AutoModelForCausalLM

    def laid_out(compile: bool):
        torch.manual_seed(0)
        model = auto.from_config(config)
        return hp.apply_strategy(model, mesh, {"tp": 2, "compile": compile, "recompute": True}, plan_for(config))

    variants = {"hp_recompute": laid_out(False), "hp_compiled_recompute": laid_out(True)}
    if "_vl" in family:
        batch = tiny_vl_batch(variants["hp_recompute"], seq=64)
        del batch["position_ids"]  # HF computes them from mm_token_type_ids, as in training
    else:
        ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
    compare(family, variants, batch, reps, emit)


def compare(name: str, variants: dict, batch: dict, reps: int, emit, per_layer: int | None = None) -> None:
    """Each of `variants` checked on its first step against the first's loss, then timed interleaved."""
    # AdamW's multi-tensor path, its default on accelerators (on CPU torch picks a per-tensor loop,
    # whose per-parameter dispatch an accelerator step does not pay); the same for every configuration
    optimizers = {k: torch.optim.AdamW(_groups(m), lr=1e-4, foreach=True) for k, m in variants.items()}
    ranks = dist.get_world_size()
    losses = {}
    for key in list(variants):
        try:
            losses[key] = train_step(variants[key], optimizers[key], batch)
        except Exception as e:  # noqa: BLE001  reported, not hidden: the record says why
            emit({"bench": "overhead_fails", "model": name, "ranks": ranks, "config": key,
                  "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            del variants[key]
    first = next(iter(losses.values()))
    for key, loss in losses.items():
        rel = abs(loss - first) / abs(first)
        if rel > 1e-5:
            raise AssertionError(f"{name}/{key}: loss {loss} differs from {next(iter(losses))}'s {first} ({rel:.1e})")
    for key in variants:  # a second warm-up step: compiled code and caches settle
        train_step(variants[key], optimizers[key], batch)
    frames = _compiled_frames()
    times = {key: [] for key in variants}
    for r in range(reps):
        order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
        for key in order:
            dist.barrier()
            start = time.perf_counter()
            train_step(variants[key], optimizers[key], batch)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[key].append(elapsed.item())
    base_s = statistics.median(next(iter(times.values())))
    for key, seconds in times.items():
        median = statistics.median(seconds)
        emit({"bench": "overhead", "model": name, "ranks": ranks, "config": key, "median_s": round(median, 5),
              "min_s": round(min(seconds), 5), "round_s": [round(t, 5) for t in seconds],
              **({"host_ms_per_layer": round((median - base_s) / per_layer * 1e3, 3)} if per_layer else {}),
              **({"recompiles_after_warmup": _compiled_frames() - frames} if "compiled" in key else {})})


def train_step(model, optimizer, batch: dict) -> float:
    """One step: forward with labels, backward, the optimizer; the loss (whole, if laid out)."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _groups(model) -> list[dict]:
    """A DTensor and a plain tensor cannot meet in one optimizer op: one group each."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


def summarize(records: list[dict]) -> dict:
    steps = {(r["model"], r["ranks"], r["config"]): r for r in records if r.get("bench") == "overhead"}

    def ratio(model, ranks, mine, theirs):
        """The median over rounds of the two configurations' ratio in that round (both ran back to back)."""
        a, b = steps.get((model, ranks, mine)), steps.get((model, ranks, theirs))
        if not (a and b):
            return None
        return round(statistics.median(x / y for x, y in zip(a["round_s"], b["round_s"])), 4)

    compiled = [r for r in steps.values() if "compiled" in r["config"]]
    families = [r for r in compiled if r["model"] in FAMILIES]
    return {
        "summary": True,
        "median_s": {f"{m}/{n}/{c}": r["median_s"] for (m, n, c), r in steps.items()},
        "host_ms_per_layer": {f"{m}/{n}/{c}": r["host_ms_per_layer"] for (m, n, c), r in steps.items()
                              if c != "plain" and "host_ms_per_layer" in r},
        "hp_vs_torch": {f"{m}/{n}": ratio(m, n, "hp", "torch") for m in MODELS for n in (1, 2)},
        "failed": [f"{r['model']}/{r['ranks']}/{r['config']}: {r['error']}" for r in records if r.get("bench") == "overhead_fails"],
        "host_ratio_vs_torch": ratio("tiny", 1, "hp", "torch"),
        "compiled_vs_eager": ratio("512", 2, "hp_compiled", "hp"),
        "compiled_vs_eager_recompute": ratio("512", 2, "hp_compiled_recompute", "hp_recompute"),
        "moe_compiled_vs_eager_recompute": ratio("qwen3_moe", 2, "hp_compiled_recompute", "hp_recompute"),
        "vl_compiled_vs_eager_recompute": ratio("qwen2_5_vl", 2, "hp_compiled_recompute", "hp_recompute"),
        "moe_vl_recompiles_after_warmup": max((r["recompiles_after_warmup"] for r in families), default=None),
        "recompiles_after_warmup": max((r["recompiles_after_warmup"] for r in compiled), default=None),
    }


if __name__ == "__main__":
    main()

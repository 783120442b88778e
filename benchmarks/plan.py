"""`hp plan`, checked: dry runs at thousands of ranks, and each rank's step memory predicted beside what a run allocates.

Dry runs: one model and strategy laid out on a fake world of its size in this process (hp.plan.dry_run), with
rank 0's parameters and the seconds it took.

Memory: for each configuration, `hp.plan.memory.trace_step` predicts rank 0's peak over a steady training step
(traced on fake tensors at the target world, in this process; on gloo's, with the buffers gloo allocates beside a
collective, `hp.plan.memory.LIBRARY_BUFFERS`), and `measure_step` measures the same step run for real, counted by
torch's memory tracker (every tensor storage allocated, not RSS, which holds the runtime):
- on 2 gloo processes, each pinned to a core of its own (rank 0's figures), for the `REAL` configurations;
- on a world of 4 or 8 simulated ranks for the `SIMULATED` ones: real tensors, every op and every collective's
  output allocated as in a run, on a `fake` process group (collectives move no values, which the memory of a
  dense model does not depend on).
Each line prints the prediction beside the measurement and their relative error, with the breakdown measured.

Time: for each `REAL` configuration, `hp.plan.step_time` predicts rank 0's step on the `cpu` profile, which the
gloo ranks measure first (`measure_cpu`, each on its core, one thread; gloo's link between them, `measure_link`),
beside the median of 5 steps the two ranks run together (`measure_seconds`).

The last line carries the issue's figures: `memory_error_max` and `memory_error_mean` (|predicted - measured| /
measured peak), `time_error_median` and `time_error_max` (|predicted - measured| / measured step, over
`configs_timed`), `configs_measured`, `dry_run_world_max` and `dry_run_s_max`, and for Qwen2.5-0.5B's shapes at 2
ranks (full fine-tuning, fp32, 2 rows of 256 tokens in all): `fsdp_states_vs_zero_formula` (rank 0's parameters,
gradients and AdamW states at the update under FSDP, over ZeRO-3's 16 bytes x parameters / 2) and
`fsdp_peak_vs_tp_peak` (the measured peaks); `auto_vs_best_measured`: every candidate `hp plan --search` ranks for
the Llama on 2 ranks (`SEARCHED`) is timed there too, and the figure is the measured step of the one it ranks first
over the fastest measured; `published_memory_ratio_worst`: torchtitan's published Llama 3.1 8B runs (`PUBLISHED`),
each traced at its size beside the memory published, the worst of predicted/published and its inverse.

    python benchmarks/plan.py
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.multiprocessing as mp

from hp.models import tiny_config
from hp.parallel.finetune import Finetuning, Lora
from hp.plan import dry_run, reference_config
from hp.plan.dry_run import describe
from hp.plan.devices import GIB, DeviceProfile, measure_cpu, measure_link
from hp.plan.memory import StepMemory, measure_step, trace_step
from hp.plan.search import search, strategies
from hp.plan.step import StepShape
from hp.plan.step_time import measure_seconds, predict, trace_work
from ranks import free_port

DRY_RUNS = [
    ("llama-3.1-405b", {"dp": 512, "tp": 8, "fsdp": True}),
    ("llama-3.1-405b", {"dp": 256, "cp": 2, "tp": 8, "sp": True, "fsdp": True}),
    ("deepseek-v3", {"dp": 512, "ep": 64, "tp": 8, "fsdp": True}),
    ("qwen3-235b-a22b", {"dp": 4096, "ep": 64, "fsdp": True}),
    ("qwen2.5-vl-72b", {"dp": 512, "tp": 8, "fsdp": True}),
]

LORA = Finetuning(lora=Lora(rank=8))
SHAPE = StepShape(rows=4, tokens=128)
BIG = StepShape(rows=2, tokens=256)  # Qwen2.5-0.5B's run: 1 row of 256 tokens per rank under FSDP


def model(name: str):
    """The configs measured: a Llama of 256 features and 4 layers, three other families' tiny ones, and Qwen2.5-0.5B's
    shapes (494M parameters, its 151,936-token head tied to its embedding)."""
    if name == "llama":
        return tiny_config("llama", layers=4, vocab_size=8192, hidden_size=256, intermediate_size=688,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    if name == "qwen2.5-0.5b":
        return reference_config(name)
    return tiny_config(name, layers=2, vocab_size=4096)


# (model, strategy, shape, finetuning)
REAL = [
    ("llama", {"dp": 2}, SHAPE, None),
    ("llama", {"dp": 2, "fsdp": True}, SHAPE, None),
    ("llama", {"dp": 2, "fsdp": True, "recompute": True}, SHAPE, None),
    ("llama", {"tp": 2}, SHAPE, None),
    ("llama", {"tp": 2, "sp": True}, SHAPE, None),
    ("llama", {"tp": 2, "sp": True, "recompute": True}, SHAPE, None),
    ("llama", {"cp": 2, "cp_algorithm": "ring"}, SHAPE, None),
    ("llama", {"cp": 2, "cp_algorithm": "ulysses"}, SHAPE, None),
    ("llama", {"dp": 2}, StepShape(rows=4, tokens=128, bf16=True), None),
    ("llama", {"tp": 2, "sp": True}, StepShape(rows=4, tokens=128, bf16=True), None),
    ("llama", {"dp": 2, "fsdp": True}, SHAPE, LORA),
    ("llama", {"tp": 2}, SHAPE, LORA),
    ("gemma3_text", {"tp": 2, "sp": True}, SHAPE, None),
    ("phi3", {"tp": 2}, SHAPE, None),
    ("qwen2", {"dp": 2, "fsdp": True}, SHAPE, None),
    ("qwen2.5-0.5b", {"dp": 2, "fsdp": True}, BIG, None),
    ("qwen2.5-0.5b", {"tp": 2}, BIG, None),
]
# `hp plan --search`'s candidates for the Llama above on these 2 ranks; those REAL does not measure are timed too
SEARCHED = strategies(2)
SEARCHED_TIMED = [s for s in SEARCHED if ("llama", s, SHAPE, None) not in REAL]
SIMULATED = [
    ("llama", {"dp": 4, "tp": 2, "sp": True}, StepShape(rows=8, tokens=128), None),
    ("llama", {"dp": 2, "tp": 2, "fsdp": True}, SHAPE, None),
    ("llama", {"dp": 8, "fsdp": True}, StepShape(rows=8, tokens=128), None),
    ("llama", {"tp2d": {"x": 2, "y": 2}}, SHAPE, None),
    ("llama", {"cp": 4, "cp_algorithm": "ring"}, SHAPE, None),
    ("llama", {"cp": 2, "tp": 2, "sp": True}, SHAPE, None),
    ("llama", {"dp": 2, "cp": 2, "fsdp": True, "recompute": True}, SHAPE, None),
    ("llama", {"tp": 4, "sp": True, "recompute": True}, SHAPE, None),
    ("qwen2", {"tp": 4}, SHAPE, None),
]


# torchtitan's published Llama 3.1 8B runs on 8 and 128 H100s (96 GB), bf16 under FSDP2, AdamW (its repository's
# benchmarks/llama3_h100_202412_torchtitan.md, Tables 1-3): (row, strategy, rows per device, tokens, GiB published)
BF16_FSDP = {"fsdp": True, "param_dtype": "bfloat16", "reduce_dtype": "float32", "recompute": True}
PUBLISHED = [
    ("Table 1: FSDP 8, selective AC", {"dp": 8, **BF16_FSDP}, 2, 8192, 82.4),
    ("Table 2: FSDP 8, CP 1", {"dp": 8, **BF16_FSDP}, 1, 32768, 83.9),
    ("Table 2: FSDP 4, CP 2", {"dp": 4, "cp": 2, "cp_algorithm": "ring", **BF16_FSDP}, 1, 65536, 84.2),
    ("Table 2: FSDP 2, CP 4", {"dp": 2, "cp": 4, "cp_algorithm": "ring", **BF16_FSDP}, 1, 131072, 84.0),
    ("Table 2: FSDP 1, CP 8", {"cp": 8, "cp_algorithm": "ring", **BF16_FSDP}, 1, 262144, 84.5),
    ("Table 3: FSDP 128, selective AC", {"dp": 128, **BF16_FSDP}, 2, 8192, 67.0),
]


def _published() -> float:
    """Each published row's peak predicted by `trace_step` beside the GiB published; the worst of predicted/published
    and its inverse."""
    ratios = []
    for row, strategy, rows, tokens, gib in PUBLISHED:
        dp = strategy.get("dp", 1)
        predicted = trace_step(reference_config("llama-3.1-8b"), strategy, StepShape(rows * dp, tokens, bf16=True))
        ratio = predicted.peak / (gib * GIB)
        ratios.append(max(ratio, 1 / ratio))
        print(json.dumps({"published": row, "strategy": strategy, "tokens": tokens, "published_gib": gib,
                          "predicted_gib": round(predicted.peak / GIB, 2), "ratio": round(ratio, 3),
                          "predicted": predicted.to_dict()}), flush=True)
    return round(max(ratios), 3)


def _rank(rank: int, port: int, out) -> None:
    """One of the 2 gloo ranks: every REAL configuration's memory and step time measured, and this machine's profile
    (its link measured by both ranks); rank 0 sends its figures back."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    cpu = measure_cpu(link=measure_link())  # every rank: its DTensor figure is taken on a mesh over the world
    if rank == 0:
        out.put(cpu)
    for name, strategy, shape, finetuning in REAL:
        measured = measure_step(model(name), strategy, shape, finetuning)
        seconds = measure_seconds(model(name), strategy, shape, finetuning)
        if rank == 0:
            out.put((measured.to_dict(), seconds))
    for strategy in SEARCHED_TIMED:
        seconds = measure_seconds(model("llama"), strategy, SHAPE)
        if rank == 0:
            out.put(seconds)
    torch.distributed.destroy_process_group()


def _measured_on_gloo() -> tuple[DeviceProfile, list[tuple[StepMemory, float]], list[float]]:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    cpu = out.get(timeout=600)
    figures = [(StepMemory(**memory), seconds) for memory, seconds in (out.get(timeout=1800) for _ in REAL)]
    searched = [out.get(timeout=1800) for _ in SEARCHED_TIMED]
    for process in ranks:
        process.join()
        assert process.exitcode == 0, f"a gloo rank ended with {process.exitcode}"
    return cpu, figures, searched


def _line(name: str, strategy: dict, shape: StepShape, finetuning, where: str, predicted: StepMemory,
          measured: StepMemory) -> dict:
    error = abs(predicted.peak - measured.peak) / measured.peak
    row = {"model": name, "strategy": strategy, "rows": shape.rows, "tokens": shape.tokens, "bf16": shape.bf16,
           "lora": finetuning is not None, "measured_on": where, "predicted_peak": predicted.peak,
           "measured_peak": measured.peak, "error": round(error, 4), "measured": measured.to_dict()}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    runs = []
    for name, strategy in DRY_RUNS:
        run = dry_run(reference_config(name), strategy)
        runs.append(run)
        print(json.dumps({"model": name, "strategy": run.strategy, "world": run.world,
                          "rank_parameters": run.rank_parameters, "seconds": round(run.seconds, 2)}), flush=True)
    cpu, on_gloo, searched = _measured_on_gloo()
    rows, times = [], []
    for (name, strategy, shape, finetuning), (measured, seconds) in zip(REAL, on_gloo):
        predicted = trace_step(model(name), strategy, shape, finetuning, backend=cpu.backend)
        rows.append(_line(name, strategy, shape, finetuning, "2 gloo processes", predicted, measured))
        step = predict(trace_work(model(name), strategy, shape, finetuning), cpu)
        times.append(abs(step.total - seconds) / seconds)
        print(json.dumps({"model": name, "strategy": strategy, "bf16": shape.bf16, "lora": finetuning is not None,
                          "predicted_s": round(step.total, 4), "measured_s": round(seconds, 4),
                          "time_error": round(times[-1], 4), **{k: round(v, 4) for k, v in step.to_dict().items()}}),
              flush=True)
    auto = _auto_vs_best(cpu, on_gloo, searched)
    for name, strategy, shape, finetuning in SIMULATED:
        predicted = trace_step(model(name), strategy, shape, finetuning)
        measured = measure_step(model(name), strategy, shape, finetuning)
        rows.append(_line(name, strategy, shape, finetuning, "simulated ranks", predicted, measured))
    published = _published()
    errors = [row["error"] for row in rows]
    big = {("fsdp" if row["strategy"].get("fsdp") else "tp"): row for row in rows if row["model"] == "qwen2.5-0.5b"}
    params = dry_run(model("qwen2.5-0.5b"), {"dp": 2, "fsdp": True}).parameters
    fsdp = big["fsdp"]["measured"]
    print(json.dumps({
        "memory_error_max": round(max(errors), 4), "memory_error_mean": round(statistics.fmean(errors), 4),
        "time_error_median": round(statistics.median(times), 4), "time_error_max": round(max(times), 4),
        "configs_timed": len(times),
        "configs_measured": len(rows),
        "dry_run_world_max": max(r.world for r in runs), "dry_run_s_max": round(max(r.seconds for r in runs), 2),
        "fsdp_states_vs_zero_formula": round(fsdp["model_states"] / (16 * params / 2), 3),
        "fsdp_peak_vs_tp_peak": round(fsdp["peak"] / big["tp"]["measured"]["peak"], 3),
        "auto_vs_best_measured": auto,
        "published_memory_ratio_worst": published}))


def _auto_vs_best(cpu: DeviceProfile, on_gloo: list[tuple[StepMemory, float]], searched: list[float]) -> float:
    """`hp plan --search`'s first candidate for the Llama on 2 ranks of this machine: its measured step over the
    fastest measured candidate's (of `SEARCHED` only). One line per candidate, predicted beside measured."""
    measured = {describe(s): seconds for (name, s, shape, tuning), (_, seconds) in zip(REAL, on_gloo)
                if name == "llama" and shape == SHAPE and tuning is None}
    measured.update((describe(s), seconds) for s, seconds in zip(SEARCHED_TIMED, searched))
    ranked = search(model("llama"), 2, SHAPE.rows // 2, SHAPE.tokens, cpu, among=SEARCHED)
    for place, candidate in enumerate(ranked):
        print(json.dumps({"search_rank": place, "strategy": candidate.strategy, "refused": candidate.refused,
                          "predicted_s": round(candidate.time.total, 4) if candidate.time else None,
                          "measured_s": round(measured[describe(candidate.strategy)], 4)}), flush=True)
    picked = next(c for c in ranked if c.runs)
    fastest = min(measured[describe(s)] for s in SEARCHED)
    return round(measured[describe(picked.strategy)] / fastest, 3)


if __name__ == "__main__":
    main()

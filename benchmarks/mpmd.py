"""`hp.mpmd` on a Qwen3-MoE (ep=2) and a Llama (tp=2 with sp): step time, communication, what stays exposed, masking.

Why: `hp.mpmd` pipelines the expert-parallel all-to-alls and the
tensor-parallel gathers, reduce-scatters and all-reduces over token chunks
(`hp.ops.expert_parallel`, `hp.ops.pipelined_linear`), so that one chunk's
collective flies while another chunk computes. This measures what that
hides, on the machine at hand: 2 real gloo ranks launched from this script,
each bound to its own core (`ranks.bind_to_cores`, as `taskset` would),
two HF models (fp32, batch 2 x 512 tokens per rank, 2 layers, vocabulary
2048), each sized so that its layers compute longer than they communicate:

* `moe`: `Qwen3MoeForCausalLM`, hidden 256, 8 experts of width 512, top-2,
  8 query / 4 KV heads of dim 32, laid out by `hp.Strategy(dp=2, ep=2)`;
* `tp`: `LlamaForCausalLM`, hidden 512, MLP width 2048, 8 query / 4 KV
  heads of dim 64, laid out by `hp.Strategy(tp=2, sp=True)`.

Each configuration is `hp.mpmd(step, chunks=c)` around one training step
(forward with labels, backward, `hp.reduce_gradients`, AdamW), for c = 1
(as it is), 2 and 4, timed interleaved (the order rotates each round) after
its first three calls (warm-up, the measured step as it is, the first
pipelined one). The communication time is the plain step's (c = 1) time
with hp's collectives in flight, from issue to landing: the whole time they
took, waiting for the other rank included; its median over the same
rounds. The exposed time is what a pipelined step spends blocked on them;
`masking_<case>` is 1 - exposed / communication, rank 0's medians (the step
times are the slowest rank's), at the chunk count that masks most. It is
the strict measure: a collective that takes longer while it competes with
computation for the CPU counts as less hidden. `timeline_masking_<case>`
is the profiler's measure on the pipelined step itself (its timeline,
`hp.mpmd.timeline`): the time collectives flew while the rank computed,
over the time they were in flight, each landing as gloo's work future
reports it. `comm_cpu_share_<case>` is the CPU time a rank's process
spends per second of the case's collectives waited as issued (gloo's
threads, the kernel's loopback copies, the copies that lay the blocks out;
a thread waiting on gloo does not spin): with one core per rank, only
the rest (1 - share, the time the process leaves its core idle while it
waits) can ever be filled with computation, so it bounds the step time
pipelining can save; a collective in flight beside a matmul takes its CPU
from the matmul. `peer_wait_share_<case>` is the share
of the pipelined step's exposed time that rank 0 spent waiting for the
other rank to issue the same collective (`hp.mpmd.timeline.waiting_for_peers`):
time no overlap on rank 0 could have hidden. With matplotlib, each case's last 2-chunk step is
drawn to `benchmarks/mpmd_<case>.png`. Only ratios within one run mean
anything on a shared machine. Of a chunked layer, the first chunk's
collective (nothing computes before it) and the last chunk's (nothing
computes after it) stay exposed, in forward and in backward: with c chunks
about 1/c of the time remains.

    python benchmarks/mpmd.py [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import DONE, adamw, bind_to_cores, emitter, run_ranks

RANKS = 2
CHUNKS = (1, 2, 4)


@dataclass(frozen=True)
class Settings:
    vocab: int = 2048
    hidden: int = 256  # the MoE model's
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    moe_ffn: int = 512
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    dense_hidden: int = 512  # the Llama's: its matmuls outweigh its gathers and reductions
    dense_ffn: int = 2048
    batch: int = 2  # per rank
    seq: int = 512
    reps: int = 7


CASES = ("moe", "tp")  # Qwen3-MoE at dp=2 ep=2; Llama at tp=2 with sp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=Settings.reps, help="timed steps per configuration")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = Settings(reps=args.reps)
    if args.worker:
        worker(settings)
    else:
        launch(settings)


def launch(settings: Settings) -> None:
    started = time.perf_counter()
    records, _ = run_ranks(__file__, RANKS, ["--reps", str(settings.reps)], "mpmd")
    summary: dict = {"summary": True}
    details = {}
    for case in CASES:
        runs = {r["chunks"]: r for r in records if r.get("bench") == "mpmd_step" and r["case"] == case}
        comm = runs[1]["flight_s"]  # the plain step's whole communication time
        masking = {c: round(1 - r["exposed_s"] / comm, 4) for c, r in runs.items()}
        best = max((c for c in masking if c > 1), key=masking.get)
        details[case] = {
            "chunks": best,
            "comm_s": comm,
            "exposed_s_by_chunks": {c: r["exposed_s"] for c, r in runs.items()},
            "peer_wait_s_by_chunks": {c: r["peer_wait_s"] for c, r in runs.items()},
            "flight_s_by_chunks": {c: r["flight_s"] for c, r in runs.items()},
            "masking_by_chunks": masking,
            "step_ratio_by_chunks": {c: round(r["step_s"] / runs[1]["step_s"], 4) for c, r in runs.items() if c > 1},
            "step_s_by_chunks": {c: r["step_s"] for c, r in runs.items()},
            "planner_masking_by_chunks": {c: r["masking"] for c, r in runs.items() if c > 1},
            "timeline_masking_by_chunks": {c: r["timeline_masking"] for c, r in runs.items()},
            "same_losses": all(r["loss_rel_err"] <= 1e-5 for r in runs.values()),
        }
        summary[f"masking_{case}"] = masking[best]
        summary[f"step_ratio_{case}"] = round(runs[best]["step_s"] / runs[1]["step_s"], 4)
        summary[f"timeline_masking_{case}"] = runs[best]["timeline_masking"]
        summary[f"peer_wait_share_{case}"] = round(runs[best]["peer_wait_s"] / runs[best]["exposed_s"], 4)
        summary[f"comm_cpu_share_{case}"] = next(r["cpu_share"] for r in records
                                                 if r.get("bench") == "mpmd_comm_cpu" and r["case"] == case)
    summary.update(details)
    summary["inputs"] = {**asdict(settings), "ranks": RANKS, "dtype": "float32"}
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


def _model(case: str, s: Settings):
    """(HF model, strategy) of a case, seeded alike for every chunk count."""
    import hp
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    if case == "moe":
        config = Qwen3MoeConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                                num_experts=s.experts, num_experts_per_tok=s.top_k, moe_intermediate_size=s.moe_ffn,
                                intermediate_size=s.moe_ffn, num_attention_heads=s.heads,
                                num_key_value_heads=s.kv_heads, head_dim=s.head_dim, max_position_embeddings=s.seq)
        config._experts_implementation = "grouped_mm"
        return AutoModelForCausalLM.from_config(config), hp.Strategy(dp=RANKS, ep=RANKS)
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.dense_hidden, num_hidden_layers=s.layers,
                         intermediate_size=s.dense_ffn, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.dense_hidden // s.heads, max_position_embeddings=s.seq, use_cache=False)
    return AutoModelForCausalLM.from_config(config), hp.Strategy(tp=RANKS, sp=True)


def worker(s: Settings) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bind_to_cores(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    emit = emitter(rank)
    import hp
    from hp.models import plan_for
    from hp.plot import pyplot

    for case in CASES:
        steps = {}
        for chunks in CHUNKS:
            model, strategy = _model(case, s)
            mesh = hp.strategy_mesh(strategy)
            ids = torch.randint(0, s.vocab, (strategy.dp * s.batch, s.seq), generator=torch.Generator().manual_seed(0))
            model = hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
            optimizer = adamw(model.parameters())

            def step(model=model, optimizer=optimizer, ids=ids):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                hp.reduce_gradients(model)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return float(loss.full_tensor())

            run = hp.mpmd(step, chunks=chunks)
            first = [run(), run(), run()]  # warm-up, the step as it is measured, then pipelined
            steps[chunks] = (run, first)
        _time(case, steps, s, emit)
        emit({"bench": "mpmd_comm_cpu", "case": case, "cpu_share": round(_comm_cpu_share(case, s), 3)})
        if pyplot() is not None:  # the last 2-chunk step of each rank: benchmarks/mpmd_<case>.png
            steps[2][0].draw(str(Path(__file__).with_name(f"mpmd_{case}.png")))
    dist.barrier()
    emit({DONE: True})


def _time(case: str, steps: dict, s: Settings, emit) -> None:
    """Each chunk count's steps, interleaved; one record per count."""
    from hp.mpmd.timeline import gathered, waiting_for_peers

    rounds = {c: [] for c in CHUNKS}
    for r in range(s.reps):
        order = CHUNKS[r % len(CHUNKS):] + CHUNKS[:r % len(CHUNKS)]
        for chunks in order:
            run = steps[chunks][0]
            dist.barrier()
            run()
            report = run.report
            lines = gathered(report.timeline)
            rounds[chunks].append((max(line.seconds for line in lines), report.exposed_seconds,
                                   report.timeline.flight_seconds, report.masking, report.timeline.masking,
                                   waiting_for_peers(lines)[dist.get_rank()]))
    want = steps[1][1][2]
    for chunks in CHUNKS:
        run, first = steps[chunks]
        measured = rounds[chunks]
        emit({"bench": "mpmd_step", "case": case, "chunks": chunks, "planned_chunks": run.plan.chunks,
              "step_s": round(statistics.median(m[0] for m in measured), 4),
              "exposed_s": round(statistics.median(m[1] for m in measured), 5),
              "flight_s": round(statistics.median(m[2] for m in measured), 5),
              "masking": round(statistics.median(m[3] for m in measured), 4),
              "timeline_masking": round(statistics.median(m[4] for m in measured), 4),
              "peer_wait_s": round(statistics.median(m[5] for m in measured), 5),
              "loss_rel_err": abs(first[2] - want) / abs(want)})  # the first pipelined step


def _comm_cpu_share(case: str, s: Settings) -> float:
    """The CPU this process burns per second of its case's collectives, waited as issued (hp's gloo path).

    A rank blocked on a collective does not compute, so only the part of the collective's time
    that its process leaves the core idle (1 - this share) can be given to computation: the most
    a pipelined step can save.
    """
    import resource

    from hp.ops.collectives import all_to_all, all_gather, reduce_scatter

    group = dist.group.WORLD
    tokens = torch.randn(s.batch, s.seq, s.dense_hidden if case == "tp" else s.hidden)
    if case == "tp":  # the sequence-parallel gather of a layer's input, the reduce-scatter of its output
        collectives = [lambda: all_gather(tokens.chunk(RANKS, 1)[0], 1, group),
                       lambda: reduce_scatter(tokens, 1, group)]
    else:  # the dispatch of every token's top-k rows, evenly split
        rows = tokens.flatten(0, 1).repeat(s.top_k, 1)
        even = [rows.shape[0] // RANKS] * RANKS
        collectives = [lambda: all_to_all(rows, even, even, group)]

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_SELF)
        return used.ru_utime + used.ru_stime

    busy = wall = 0.0
    for rep in range(23):
        for collective in collectives:
            dist.barrier()
            c0, t0 = cpu(), time.perf_counter()
            collective()
            if rep >= 3:  # after warm-up
                busy, wall = busy + cpu() - c0, wall + time.perf_counter() - t0
    return busy / wall


if __name__ == "__main__":
    main()

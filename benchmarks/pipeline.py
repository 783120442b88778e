"""Pipeline parallel: exact steps on real ranks, each schedule's bubble against its formula, and the
cost-balanced split against torchtitan's even split.

Three parts, one run (about two minutes on 2 CPU cores):

1. **Exact** (2 real gloo ranks, one pinned per core): for every schedule hp
   names, a tiny Llama (4 layers) cut into stages by `hp.pipeline`, one step
   of 4 micro-batches with `-100` labels spread unevenly: the loss and every
   gradient against the unsharded model's (fp32, relative 1e-5). Also each
   schedule's step time there.
2. **Bubble** (4 emulated ranks): each rank's compute is slept, not run, so
   that 4 ranks fit 2 cores without sharing them: a stage's forward sleeps F,
   its input gradient B_I and its weight gradient B_W (separate autograd
   branches, so the zero-bubble schedules can run them apart), and the
   activations cross between ranks for real over gloo. Each rank's bubble
   is 1 - its compute (the sleeps, timed where each stage runs them) / the
   step; against the formula (p - 1) / (v m + p - 1) of GPipe, 1F1B and
   Interleaved1F1B (p ranks, m micro-batches, v stages per rank). The
   zero-bubble and V schedules are measured and reported, without a formula.
3. **Split** (4 emulated ranks, 1F1B, 8 micro-batches): a model of 8
   decoder blocks whose head and loss cost what a Llama-3-8B's do against its
   layers (`BlockCosts.of` at its shapes: 2.6 layers), cut by
   `hp.parallel.pipeline_split.balanced_split` and by `even_split`
   (torchtitan's: 2 blocks per stage, the head in the last), each stage's
   forward and backward slept for its cost. The arms alternate within the run.

Last line: `pp_exact` (every schedule), `bubble_vs_formula` (the largest
|measured - formula| over the modelled schedules, mean over ranks),
`balanced_vs_even_step` (step time, balanced over even).

    python benchmarks/pipeline.py [--rounds 5]
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
from ranks import DONE, bind_to_cores, emitter, gathered, run_ranks, slowest

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
FORMULA = {"GPipe", "1F1B", "Interleaved1F1B"}  # bubble (p - 1) / (v m + p - 1)
EMULATED = 4  # ranks whose compute is slept
MICROBATCHES = 8
F_S = 0.012  # a stage's forward; its input and weight gradients each take as long
SPLIT_UNIT_S = 0.004  # one decoder block's forward in the split part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per arm")
    parser.add_argument("--part", choices=("real", "emulated"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args()
    if args.worker:
        real_worker() if args.part == "real" else emulated_worker(args.rounds)
        return
    started = time.perf_counter()
    records = run_ranks(__file__, 2, ["--part", "real"], "pipeline (real)")[0]
    records += run_ranks(__file__, EMULATED, ["--rounds", str(args.rounds), "--part", "emulated"],
                         "pipeline (emulated)")[0]
    summary = summarize(records)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


# ---- 1. exact, on real ranks --------------------------------------------------------------------


def real_worker() -> None:
    bind_to_cores(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.set_num_threads(1)
    emit = emitter(int(os.environ["RANK"]))
    for schedule in SCHEDULES:
        error, seconds = exact(schedule)
        emit({"bench": "pipeline_exact", "schedule": schedule, "exact": error < 1e-5, "max_rel_error": error,
              "step_s": seconds})
    dist.barrier()
    emit({DONE: True})


def exact(schedule: str) -> tuple[float, float]:
    """The largest relative error of the step's loss and gradients against the unsharded model's; the
    step's time (the slowest rank's)."""
    import hp
    from hp.models import plan_for, tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama", layers=4)
    reference, model = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, 32), generator=g)
    labels = ids.clone()
    labels[:, :16] = -100
    labels[1, :-1] = -100  # a row with one supervised token
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    strategy = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": 4}
    pipe = hp.pipeline(model, hp.strategy_mesh(strategy), strategy, plan_for(config))
    pipe.step(ids, labels)  # warm-up: the schedule's first step also sets up its buffers
    for p in pipe.parameters():
        p.grad = None
    dist.barrier()
    start = time.perf_counter()
    got = pipe.step(ids, labels)
    seconds = slowest(time.perf_counter() - start)
    errors = [abs(got.item() - want.item()) / want.item()]
    grads = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # laid out on the stage's mesh
        errors.append(((grad - grads[name].grad).norm() / grads[name].grad.norm()).item())
    return slowest(max(errors)), round(seconds, 4)


# ---- 2 and 3. emulated ranks --------------------------------------------------------------------


class _Slept(torch.autograd.Function):
    """Sleeps `seconds` in forward and `back` in backward; the tensor passes unchanged."""

    @staticmethod
    def forward(ctx, x, seconds: float, back: float, clock: list):
        ctx.back, ctx.clock = back, clock
        _sleep(seconds, clock)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.back, ctx.clock)
        return grad.clone(), None, None, None


def _sleep(seconds: float, clock: list) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    clock[0] += time.perf_counter() - start


class SleptStage(torch.nn.Module):
    """A stage whose forward sleeps `forward_s`, whose input gradient sleeps `forward_s` and whose weight
    gradient sleeps `forward_s` more (its own autograd branch, run apart by the zero-bubble schedules)."""

    def __init__(self, forward_s: float, clock: list) -> None:
        super().__init__()
        self.forward_s, self.clock = forward_s, clock
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.bias = torch.nn.Parameter(torch.zeros(()))  # the first stage's input gradient runs too, as its layers' do

    def forward(self, x):
        through = _Slept.apply(x + self.bias, self.forward_s, self.forward_s, self.clock)
        weight = _Slept.apply(self.weight, 0.0, self.forward_s, self.clock)
        return through + weight


def emulated_worker(rounds: int) -> None:
    emit = emitter(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    import hp  # noqa: F401  (the process group's setup, as in a real run)

    dist.init_process_group("gloo")
    arms = [("bubble", s) for s in SCHEDULES] + [("split", "balanced"), ("split", "even")]
    times: dict = {arm: [] for arm in arms}
    busy: dict = {arm: [] for arm in arms}
    for r in range(rounds + 1):  # the first round warms up
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            step_s, compute_s = run_arm(*arm)
            if r:
                times[arm].append(step_s)
                busy[arm].append(compute_s / step_s)
    for (part, name), seconds in times.items():
        step = statistics.median(seconds)
        bubbles = [1 - b for b in gathered(statistics.median(busy[(part, name)]))]
        emit({"bench": f"pipeline_{part}", "arm": name, "step_s": round(step, 4),
              "bubble_per_rank": [round(b, 3) for b in bubbles], "bubble": round(statistics.mean(bubbles), 4),
              **({"formula": round(formula(name), 4)} if part == "bubble" and name in FORMULA else {})})
    dist.barrier()
    emit({DONE: True})


def formula(schedule: str, p: int = EMULATED, m: int = MICROBATCHES) -> float:
    """The bubble of a schedule with uniform stages: (p - 1) / (v m + p - 1)."""
    v = 2 if schedule == "Interleaved1F1B" else 1
    return (p - 1) / (v * m + p - 1)


def run_arm(part: str, name: str) -> tuple[float, float]:
    """One step of an arm; (the slowest rank's step, this rank's compute)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from hp.parallel.pipeline import stages_of_rank
    from hp.parallel.strategy import Strategy

    rank, p = dist.get_rank(), dist.get_world_size()
    schedule = name if part == "bubble" else "1F1B"
    strategy = Strategy(pp=p, pp_schedule=schedule, pp_microbatches=MICROBATCHES)
    ids = stages_of_rank(strategy, rank)
    total = strategy.pp_stages
    clock = [0.0]
    seconds = stage_seconds(name, total) if part == "split" else [F_S / strategy.stages_per_rank] * total
    stages = [PipelineStage(SleptStage(seconds[s], clock), s, total, torch.device("cpu")) for s in ids]
    cls = get_schedule_class(schedule)
    runner = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, MICROBATCHES,
                 loss_fn=lambda out, target: out.sum(), scale_grads=False)
    x = torch.zeros(MICROBATCHES, 4)
    first = any(s.is_first for s in stages)
    for _ in range(2):  # the first step sets up shapes and buffers; the second is timed
        clock[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        runner.step(x, target=x) if first else runner.step(target=x)
    step = slowest(time.perf_counter() - start)
    return step, clock[0]


def stage_seconds(split: str, stages: int) -> list[float]:
    """Each stage's forward, in seconds, for 8 Llama-3-8B-shaped blocks cut `split`'s way."""
    from transformers import AutoConfig

    from hp.parallel.pipeline_split import BlockCosts, balanced_split, even_split

    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, num_hidden_layers=8)
    costs = BlockCosts.of(config, seq=8192)
    cut = balanced_split(costs, stages) if split == "balanced" else even_split(8, stages)
    unit = SPLIT_UNIT_S / costs.blocks[0]
    return [cut.cost(costs, s) * unit for s in range(stages)]



def summarize(records: list[dict]) -> dict:
    exact = {r["schedule"]: r["exact"] for r in records if r.get("bench") == "pipeline_exact"}
    bubbles = {r["arm"]: r for r in records if r.get("bench") == "pipeline_bubble"}
    split = {r["arm"]: r["step_s"] for r in records if r.get("bench") == "pipeline_split"}
    gaps = [abs(r["bubble"] - r["formula"]) for r in bubbles.values() if "formula" in r]
    return {
        "summary": True,
        "bubble": {k: r["bubble"] for k, r in bubbles.items()},
        "formula": {k: r["formula"] for k, r in bubbles.items() if "formula" in r},
        "pp_exact": bool(exact) and all(exact.values()) and len(exact) == len(SCHEDULES),
        "bubble_vs_formula": round(max(gaps), 4) if gaps else None,
        "balanced_vs_even_step": round(split["balanced"] / split["even"], 4) if len(split) == 2 else None,
    }


if __name__ == "__main__":
    sys.exit(main())

"""hp.mpmd levels 2 and 3 against static placements: a vision tower spread into a language model's pipeline
bubbles, and a DPO reference run a batch ahead in the policy's bubbles.

Three parts, one run (about nine minutes on 2 CPU cores), the arms of each part alternating:

1. **VL, 4 emulated ranks** (each block a tiny real layer whose forward and backward last exactly the
   block's cost, the rest slept; the tensors between ranks are real and cross over gloo). A language model of 16 blocks and a vision tower worth 3 of them: 15.8% of a
   sample's work, the share of Qwen2.5-VL-7B's (the 675M tower over a 448 x 448 image's 1024 patches,
   the 7.6B LM over its 256 image and 256 text tokens: 1.31 of 8.55 TFLOP, `vl_share`); also the
   share of Qwen2.5-VL-3B's (29%: 6 blocks' worth); and the 7B share's tower frozen (LlamaFactory's
   default: no backward; in the static splits stage 0 runs its forward only, spread it runs a batch
   ahead). A block's forward takes U (10 ms), its backward 2U (U for its input's gradient, U for its
   weight's); 8 micro-batches.
   - **B0**: the tower in stage 0 of an even split (torchtitan's placement), 1F1B;
   - **B1**: the best static split of the same ranks with the tower in stage 0: every split, with the
     language model's backward whole (1F1B) or split (zero bubble: `Program(split=True)`, planned
     from the measured costs), simulated, the three best measured, the fastest kept;
   - **S**: hp's level 2: the tower spread over the ranks (`Program(spread=True)`, each micro-batch's
     images whole or cut into 2 or 4 parts), the two best of (the language model's split, the cut,
     its backward whole or split) by simulation measured, the fastest kept, and the order of every
     rank's work planned from the cost table measured on its first steps.
2. **DPO, 4 emulated ranks**, pp=4, 8 micro-batches (a policy stage's forward U, backward 2U; the
   frozen reference's stage forward U), each stage's tiny real layer computing the loss:
   - **S0**: the reference's forward pipelined before the policy's in each step;
   - **S1**: the reference precomputed before training (LlamaFactory's option), its cost counted:
     the whole dataset streamed through the reference's pipeline once, over the steps;
   - **S2**: hp's level 3: the reference a batch ahead and staggered (its stage s a further 3 - s
     batches ahead, so that none of its stages waits on another within a step), backfilled into the
     policy's bubbles; also recorded, the reference a batch ahead unstaggered, and (S2 own) the
     policy over ranks 0-1 (2 blocks a stage) with the reference on ranks 2-3.
   The losses of S0 and S2 are compared step by step (`dpo_losses_identical`); `hp.mpmd.choose_reference`,
   given S2's measured cost table, picks between S2 and S2 own (`dpo_reference_choice_agrees`: the
   one it picks measured faster).
3. **VL, 2 real ranks** (one pinned per core, real matmuls: a block is a 768-wide linear layer over 128
   rows): B0, B1 and S as above, the splits searched with a real block's times measured first
   (`calibrated`: its forward, input gradient, weight gradient and whole backward, and what a micro-batch
   cut in two loses in efficiency), three times the timed steps (real matmuls on a shared machine drift
   more than sleeps).

For every measured arm the simulator (`hp.mpmd.simulate`, replaying the arm's plan with the cost
table measured on its timed steps) predicts the step; `simulator_error` is the largest
|predicted - measured| / measured (`planned_s`: the replay with the warm-up's table the plan was made
from; the machine may drift between the two). `benchmarks/mpmd_submeshes.png` draws each arm's measured timeline.

Last line: `vl_step_vs_best_static` (S / B1, 4 emulated ranks, the 7B share; `_3b_share`, `_frozen`),
`vl_step_vs_best_static_real`
(2 real ranks; `vl_floor_vs_best_static_real`: S's least mean work per rank over B1's replayed step, the
ratio of an S that never idles), `mean_idle_share` (S's, 4 emulated ranks), `dpo_step_vs_sequential` (S2 / S0),
`dpo_losses_identical`, `dpo_reference_choice_agrees`, `simulator_error`.

    python benchmarks/mpmd_submeshes.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from mpmd_blocks import Blocks, BlockTimes, calibrated, nominal
from ranks import DONE, bind_to_cores, emitter, gathered, run_ranks, slowest

from hp.mpmd.choice import BlockCosts, choose_reference
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Flow, Graph, Program
from hp.mpmd.measure import gathered_costs, link
from hp.mpmd.plan import Plan
from hp.mpmd.reference import pair_graph
from hp.mpmd.runtime import Runtime
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import Simulation, draw_arms, simulate

MICRO = 8
BLOCKS = 16
REAL_WIDTH, REAL_ROWS = 768, 128  # a real block: a linear layer of this width over this many rows
WARMUP = 4  # steps before an arm's plan is made; the cost table is the last three's
PNG = Path(__file__).resolve().parent / "mpmd_submeshes.png"


def vl_share(vision_params: float = 0.675e9, patches: int = 1024, merged_ops: float = 2 * (5120 ** 2 + 5120 * 3584),
             text_flops_per_token: float = 14.1e9, tokens: int = 512) -> float:
    """The vision tower's share of a Qwen2.5-VL-7B sample's forward FLOPs (2 x parameters x tokens, plus the
    merger per merged token and the LM's head; attention scores left out): 1.31 / (1.31 + 7.24) TFLOP."""
    vision = 2 * vision_params * patches + merged_ops * patches / 4
    return vision / (vision + text_flops_per_token * tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per arm (the real part: 3x)")
    parser.add_argument("--part", choices=("emulated", "real"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        (emulated_worker if args.part == "emulated" else real_worker)(args.rounds)
        return
    started = time.perf_counter()
    records = run_ranks(__file__, 4, ["--rounds", str(args.rounds), "--part", "emulated"], "mpmd (emulated)")[0]
    # real matmuls on a shared machine drift more than sleeps: three times the timed steps
    records += run_ranks(__file__, 2, ["--rounds", str(3 * args.rounds), "--part", "real"], "mpmd (real)")[0]
    timelines = {f"{r['part']} {r['arm']}": r.pop("timeline") for r in records if "timeline" in r}
    try:
        draw_arms({name: Simulation(tuple(_slot(*s) for s in slots), world)
                   for name, (world, slots) in timelines.items()}, str(PNG))
    except ImportError as missing:
        print(f"no timelines drawn: {missing}", file=sys.stderr)
    print(json.dumps(summarize(records) | {"wall_s": round(time.perf_counter() - started, 1)}), flush=True)


def _slot(action: list, rank: int, start: float, end: float):
    from hp.mpmd.graph import Action
    from hp.mpmd.plan import Slot

    return Slot(Action(*action), rank, start, end)


# ---- stages ---------------------------------------------------------------------------------------------

def vl_graph(ranks: int, split: tuple[int, ...], tower: float, spread: bool, parts: int = 1,
             frozen: bool = False, zero_bubble: bool = False) -> tuple[Graph, dict]:
    """The VL step: with `spread`, the tower its own program over every rank (each micro-batch's images cut
    into `parts`; `frozen`: no backward, a batch ahead) and the LM cut by `split`; else the tower inside the
    LM's stage 0. `zero_bubble`: the LM's stages split their backward (`Program(split=True)`). Each stage's
    (forward, backward) blocks per micro-batch (of its own)."""
    lm = Program("lm", tuple(range(ranks)), split=zero_bubble)
    if spread:
        tower_program = Program("vision", tuple(range(ranks)), spread=True, parts=parts, trains=not frozen,
                                ahead=int(frozen))
        return Graph((tower_program, lm), (Flow(("vision", 0), ("lm", 0)),), MICRO), \
            {("vision", 0): (tower / parts,) * 2, **{("lm", s): (split[s],) * 2 for s in range(ranks)}}
    first = (split[0] + tower, split[0] + (0 if frozen else tower))
    return Graph((lm,), (), MICRO), {("lm", s): first if s == 0 else (split[s],) * 2 for s in range(ranks)}


def vl_stages(graph: Graph, blocks: dict, width: int, emulated: bool) -> dict:
    """Each stage's function; a real tower's piece is fewer rows through the same layers."""
    parts = graph.program["vision"].parts if "vision" in graph.program else 1
    fns = {}
    for node, (n, backward) in blocks.items():
        module = Blocks(n if emulated or node[0] != "vision" else n * parts, width, emulated,
                        seed=zlib.crc32(repr(node).encode()),  # the same on every rank (hash() is not)
                        trains=graph.trains(node), backward=backward)
        first = node == ("lm", 0) and len(graph.programs) == 1 or node[0] == "vision"
        last = node == ("lm", graph.program["lm"].stages - 1)
        fns[node] = _stage(module, first, last, parts if node[0] == "vision" else 1)
    return fns


def _stage(module: torch.nn.Module, first: bool, last: bool, parts: int):
    def run(batch: torch.Tensor, m: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        if first:
            rows = batch[m // parts]
            size = rows.shape[0] // parts
            x = rows[(m % parts) * size:(m % parts + 1) * size]
        else:
            x = inputs[0]
        out = module(x)
        return out.square().mean() if last else out
    run.module = module
    return run


# ---- measuring an arm ------------------------------------------------------------------------------------


class Arm:
    """One arm: its runtime (planned from the cost table of its first steps), its step times, its prediction."""

    def __init__(self, graph: Graph, stages: dict, plan_from_costs: bool = True, plan: Plan | None = None,
                 learning_rate: float = 0.0) -> None:
        self.graph, self.stages, self.replan = graph, stages, plan_from_costs
        self.runtime = Runtime(plan or schedule(graph, Costs.unit(graph)), stages)
        params = [p for fn in stages.values() for p in fn.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=learning_rate) if learning_rate else None
        self.times: list[float] = []
        self.losses: list[float] = []
        self.costs: Costs | None = None
        self.planned = 0.0  # the step the plan's own cost table (its warm-up's) replays to

    def step(self, batches: list, timed: bool) -> None:
        """One step of `batches[0]`; the rest are the batches after it, for the programs running ahead."""
        dist.barrier()
        start = time.perf_counter()
        losses = self.runtime.step(*batches[:1 + self.graph.furthest_ahead])
        elapsed = slowest(time.perf_counter() - start)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss = torch.tensor(float(sum(l.item() for l in losses.values())), dtype=torch.float64)
        dist.all_reduce(loss)
        self.losses.append(loss.item())
        if timed:
            self.times.append(elapsed)
        elif self.runtime.steps == 1:  # the first step pays for first touches: not a cost to plan by
            self.runtime.samples.clear()
            self.runtime.transfers.clear()
        elif self.runtime.steps == WARMUP:
            self._plan()

    def _plan(self) -> None:
        self.costs = gathered_costs(self.runtime, *LINK)
        if self.replan:
            self.runtime.replan(schedule(self.graph, self.costs))
        self.planned = simulate(self.runtime.plan, self.costs).step_seconds
        self.runtime.samples.clear()  # from here the timed steps' own: the table the simulator is checked with
        self.runtime.transfers.clear()

    def record(self, part: str, name: str) -> dict:
        """The arm's median step; the simulator's replay of its plan with the cost table of its timed steps
        (the machine drifts between warm-up and timing: the check is of the replay, not of the drift); its
        last step's idle share, from the slots of that step."""
        step = statistics.median(self.times)
        replayed = simulate(self.runtime.plan, gathered_costs(self.runtime, *LINK))
        predicted = replayed.step_seconds
        slots = gathered([(dataclasses.astuple(s.action), s.rank, s.start, s.end) for s in self.runtime.slots])
        return {"bench": "mpmd_submeshes", "part": part, "arm": name, "step_s": round(step, 4),
                "planned_s": round(self.planned, 4), "predicted_s": round(predicted, 4),
                "simulator_error": round(abs(predicted - step) / step, 4),
                "work_s": round(sum(replayed.busy) / self.graph.world, 4),  # a rank's share of the step's work
                "mean_idle_share": round(_idle(slots, self.times[-1], self.graph.world), 4),
                "timeline": [self.graph.world, [s for rank in slots for s in rank]]}


LINK = (0.0, 1e9)  # (latency, bandwidth): measured once per worker


def _idle(slots: list, step: float, world: int) -> float:
    busy = [sum(end - start for _, _, start, end in rank) for rank in slots]
    return sum(1 - b / step for b in busy) / world



def run_arms(arms: dict[str, Arm], batches, rounds: int) -> None:
    """Warm-up steps (then each arm plans), then `rounds` timed steps, the arms alternating."""
    names = list(arms)
    ahead = max(arm.graph.furthest_ahead for arm in arms.values())  # the batches after a step's that it reads
    for r in range(WARMUP + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            arms[name].step([batches(r + k) for k in range(1 + ahead)], timed=r >= WARMUP)


def best_splits(ranks: int, tower: float, spread: bool, keep: int, frozen: bool = False,
                block: BlockTimes = BlockTimes()) -> list[tuple[tuple[int, ...], int, bool]]:
    """The `keep` (split of the LM's blocks, parts of the tower's micro-batches, zero bubble) whose simulated
    step is shortest; the tower is cut into parts only when spread. With the tower in stage 0 every split
    is tried; spread, the splits within 2 blocks of even (the tower's work no longer sits in one stage),
    each micro-batch's images whole or cut into 2 or (4 ranks) 4 parts. Either way, the LM's backward
    whole (1F1B) or split (zero bubble)."""
    found = []
    for split in itertools.product(range(0 if not spread else 1, BLOCKS + 1), repeat=ranks):
        if sum(split) != BLOCKS or min(split[1:]) < 1 or (spread and max(split) - min(split) > 2):
            continue
        for parts in ((1, 2, 4) if ranks >= 4 else (1, 2)) if spread else (1,):
            for zero_bubble in (False, True):
                graph, blocks = vl_graph(ranks, split, tower, spread, parts, frozen, zero_bubble)
                costs = nominal(graph, blocks, block)
                found.append((simulate(schedule(graph, costs), costs).step_seconds, split, parts, zero_bubble))
    return [(split, parts, zero_bubble) for _, split, parts, zero_bubble in sorted(found)[:keep]]


# ---- the parts -------------------------------------------------------------------------------------------


def vl_arms(ranks: int, tower: float, width: int, emulated: bool, frozen: bool = False,
            block: BlockTimes = BlockTimes()) -> dict[str, Arm]:
    """B0, the three best static splits (B1, a split backward planned from its costs) and the two best S."""
    arms = {}
    even = tuple([BLOCKS // ranks] * ranks)
    graph, blocks = vl_graph(ranks, even, tower, spread=False, frozen=frozen)
    arms["B0"] = Arm(graph, vl_stages(graph, blocks, width, emulated), plan_from_costs=False)
    static = _on_rank_zero(lambda: best_splits(ranks, tower, False, keep=3, frozen=frozen, block=block))
    spread = _on_rank_zero(lambda: best_splits(ranks, tower, True, keep=2, frozen=frozen, block=block))
    for split, _, zb in static:
        graph, blocks = vl_graph(ranks, split, tower, spread=False, frozen=frozen, zero_bubble=zb)
        arms[f"B1 {split}{' zb' * zb}"] = Arm(graph, vl_stages(graph, blocks, width, emulated), plan_from_costs=zb)
    for split, parts, zb in spread:
        graph, blocks = vl_graph(ranks, split, tower, spread=True, parts=parts, frozen=frozen, zero_bubble=zb)
        arms[f"S {split} parts {parts}{' zb' * zb}"] = Arm(graph, vl_stages(graph, blocks, width, emulated))
    return arms


def _on_rank_zero(compute):
    """`compute()` run by rank 0 alone (a search every rank would repeat), its result on every rank."""
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def vl_batches(width: int, rows: int):
    return lambda r: torch.randn(MICRO, rows, width, generator=torch.Generator().manual_seed(r))


def emulated_worker(rounds: int) -> None:
    global LINK
    emit = emitter(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    LINK = link()
    for label, tower, frozen in (("vl", 3.0, False), ("vl 3b", 6.0, False), ("vl frozen", 3.0, True)):
        arms = vl_arms(4, tower, 8, emulated=True, frozen=frozen)
        run_arms(arms, vl_batches(8, 2), rounds)
        for name, arm in arms.items():
            emit(arm.record(f"{label} emulated", name))
    table: dict = {}
    arms = dpo_arms(table)
    run_arms({k: v for k, v in arms.items() if k != "S1"}, dpo_batches, rounds)
    emit(precomputed(arms["S1"], table, rounds) | {"part": "dpo emulated", "arm": "S1"})
    for name in ("S0", "S2", "S2 unstaggered", "S2 own"):
        emit(arms[name].record("dpo emulated", name) | {"losses": arms[name].losses})
    emit({"part": "dpo emulated", "arm": "choice"} | reference_choice(arms["S2"].costs))
    dist.barrier()
    emit({DONE: True})


def real_worker(rounds: int) -> None:
    global LINK
    bind_to_cores(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.set_num_threads(1)
    emit = emitter(int(os.environ["RANK"]))
    dist.init_process_group("gloo")
    LINK = link()
    block = calibrated(REAL_WIDTH, REAL_ROWS)  # every rank at once, each on its core; rank 0's times search
    arms = vl_arms(2, 3.0, REAL_WIDTH, emulated=False, block=block)
    run_arms(arms, vl_batches(REAL_WIDTH, REAL_ROWS), rounds)
    for name, arm in arms.items():
        emit(arm.record("vl real", name))
    dist.barrier()
    emit({DONE: True})


# ---- DPO ------------------------------------------------------------------------------------------------

BETA = 0.1


def dpo_graph(ahead: int | None, stagger: bool = False, own: bool = False) -> Graph:
    """The policy's 4 stages; the reference's 4 on the same ranks, in the step (0), a batch ahead (1), or
    none (None: precomputed); staggered or not. `own`: the policy's 2 stages on ranks 0-1, the reference's
    2 on ranks 2-3, a batch ahead and staggered."""
    if own:
        return pair_graph((0, 1), (2, 3), MICRO)
    policy = Program("policy", (0, 1, 2, 3))
    if ahead is None:
        return Graph((policy,), (), MICRO)
    reference = Program("reference", (0, 1, 2, 3), trains=False, ahead=ahead, stagger=stagger)
    return Graph((policy, reference), (Flow(("reference", 3), ("policy", 3)),), MICRO)


def dpo_stages(precomputed: dict | None = None, stages: int = 4) -> dict:
    """Each stage 4 / `stages` emulated blocks."""
    fns = {}
    for program, trains in (("policy", True), ("reference", False)):
        for s in range(stages):
            module = Blocks(4 // stages, 8, emulated=True, seed=s, trains=trains)  # the reference: the policy's start
            fns[program, s] = _dpo_stage(module, s, program == "policy" and s == stages - 1, precomputed)
    return fns


def _dpo_stage(module, s: int, last_of_policy: bool, precomputed: dict | None):
    def run(batch, m, inputs):
        out = module(batch[m] if s == 0 else inputs[0])
        if not last_of_policy:
            return out
        reference = precomputed[_key(batch[m])] if precomputed is not None else inputs[1]
        chosen, rejected = (out - reference).sum(-1)  # two rows: a chosen and a rejected answer's log-ratios
        return -torch.nn.functional.logsigmoid(BETA * (chosen - rejected)) / MICRO
    run.module = module
    return run


def _key(micro: torch.Tensor) -> float:
    """A micro-batch's name in the table of precomputed reference outputs (its random values' sum)."""
    return round(micro.sum().item(), 6)


def dpo_batches(r: int) -> torch.Tensor:
    return torch.randn(MICRO, 2, 8, generator=torch.Generator().manual_seed(1000 + r))


def dpo_arms(table: dict) -> dict[str, Arm]:
    """S0, S1 (its last stage reading the reference's outputs from `table`) and S2, each with SGD."""
    sequential = dpo_graph(0)
    return {"S0": Arm(sequential, dpo_stages(), plan_from_costs=False, plan=_sequential_plan(sequential),
                      learning_rate=0.1),
            "S1": Arm(dpo_graph(None), dpo_stages(precomputed=table), plan_from_costs=False, learning_rate=0.1),
            "S2": Arm(dpo_graph(1, stagger=True), dpo_stages(), learning_rate=0.1),
            "S2 unstaggered": Arm(dpo_graph(1), dpo_stages(), learning_rate=0.1),
            "S2 own": Arm(dpo_graph(1, own=True), dpo_stages(stages=2), learning_rate=0.1)}


def reference_choice(costs: Costs) -> dict:
    """`hp.mpmd.choose_reference` from S2's measured cost table (a stage is one block): the reference in the
    policy's bubbles or on ranks of its own, and each way's predicted step."""
    def median(kind: str, program: str) -> float:
        return statistics.median(v for (k, (p, _)), v in costs.compute.items() if k == kind and p == program)

    moving = [v for (a, b), v in costs.transfer.items() if a[0] == b[0] == "policy"]
    block = BlockCosts(median("F", "policy"), median("B", "policy"), median("F", "reference"),
                       statistics.median(moving) if moving else 0.0)
    choice = choose_reference(block, world=4, blocks=4, microbatches=MICRO)
    return {"chosen": choice.where, "predicted_s": choice.steps}


def _sequential_plan(graph: Graph) -> Plan:
    """Each rank runs the reference's forwards first, then the policy's 1F1B (what a pipelined trainer does)."""
    ref_only = Graph((graph.program["reference"],), (), MICRO)
    policy_only = Graph((graph.program["policy"],), (), MICRO)
    first, then = schedule(ref_only, Costs.unit(ref_only)), schedule(policy_only, Costs.unit(policy_only))
    return Plan(graph, {r: first.actions[r] + then.actions[r] for r in range(4)})


def precomputed(arm: Arm, table: dict, rounds: int) -> dict:
    """S1: the reference's outputs for every step's batch computed first, in one pipelined pass (timed), then
    the policy's steps (timed); the step counts the pass's share."""
    steps = WARMUP + rounds
    stream = Graph((Program("reference", (0, 1, 2, 3), trains=False),), (), MICRO * steps)
    everything = torch.cat([dpo_batches(r) for r in range(steps)])
    runtime = Runtime(schedule(stream, Costs.unit(stream)), {k: v for k, v in dpo_stages().items() if k[0] == "reference"})
    dist.barrier()
    start = time.perf_counter()
    outputs = runtime.step(everything)  # rank 3 holds the reference's outputs, by micro-batch
    pass_s = slowest(time.perf_counter() - start)
    table.update({_key(everything[m]): out for m, out in outputs.items()})
    for r in range(steps):
        arm.step([dpo_batches(r)], timed=r >= WARMUP)
    step = statistics.median(arm.times) + pass_s / steps
    return {"bench": "mpmd_submeshes", "step_s": round(step, 4), "precompute_s_per_step": round(pass_s / steps, 4)}


# ---- summary ---------------------------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict:
    def arms(part: str) -> dict:
        return {r["arm"]: r for r in records if r.get("part") == part and "step_s" in r}

    def fastest(part: str, prefix: str) -> dict | None:
        """The arm of `part` whose name starts with `prefix` and whose measured step is shortest."""
        found = [r for k, r in arms(part).items() if k.startswith(prefix)]
        return min(found, key=lambda r: r["step_s"], default=None)

    def vl_ratio(part: str) -> float | None:
        best, mine = fastest(part, "B1"), fastest(part, "S")
        return round(mine["step_s"] / best["step_s"], 3) if best and mine else None

    def vl_floor(part: str) -> float | None:
        """The least mean work per rank of an S arm over the best B1's replayed step (both from their own
        measured costs, neither with the runtime's overhead): the ratio an S with no idle at all would get."""
        best = fastest(part, "B1")
        work = min((r["work_s"] for k, r in arms(part).items() if k.startswith("S")), default=None)
        return round(work / best["predicted_s"], 3) if best and work else None

    dpo = arms("dpo emulated")
    s2 = fastest("vl emulated", "S") or {}
    errors = [r["simulator_error"] for r in records if "simulator_error" in r]
    return {
        "vl_step_vs_best_static": vl_ratio("vl emulated"),
        "vl_step_vs_best_static_3b_share": vl_ratio("vl 3b emulated"),
        "vl_step_vs_best_static_frozen": vl_ratio("vl frozen emulated"),
        "vl_step_vs_best_static_real": vl_ratio("vl real"),
        "vl_floor_vs_best_static_real": vl_floor("vl real"),
        "mean_idle_share": s2.get("mean_idle_share"),
        "dpo_step_vs_precomputed": round(dpo["S2"]["step_s"] / dpo["S1"]["step_s"], 3) if dpo else None,
        "dpo_step_vs_sequential": round(dpo["S2"]["step_s"] / dpo["S0"]["step_s"], 3) if dpo else None,
        "dpo_unstaggered_vs_sequential": round(dpo["S2 unstaggered"]["step_s"] / dpo["S0"]["step_s"], 3) if dpo else None,
        "dpo_losses_identical": bool(dpo) and dpo["S0"]["losses"] == dpo["S2"]["losses"] == dpo["S2 unstaggered"]["losses"],
        "dpo_reference_choice_agrees": _choice_agrees(records),
        "simulator_error": round(max(errors), 3) if errors else None,
    }


def _choice_agrees(records: list[dict]) -> bool | None:
    """Whether `choose_reference` picked the placement whose measured step was shorter."""
    found = {r["arm"]: r for r in records if r.get("part") == "dpo emulated"}
    if "choice" not in found:
        return None
    faster = "shared" if found["S2"]["step_s"] <= found["S2 own"]["step_s"] else "own"
    return found["choice"]["chosen"] == faster


if __name__ == "__main__":
    sys.exit(main())

"""Worker for test_mpmd_programs.py: plans of MPMD steps run on gloo ranks against the same step in one process.

Each case (argv[1], a JSON list drawn by the test) is a graph of three programs: an encoder (fixed on a
rank, or spread over the ranks; each micro-batch whole or cut in two), a two-stage model whose last stage
computes the loss (its backward whole or split into input and weight gradients), and a frozen
two-stage reference feeding that loss, run in the same step or a batch ahead, its first stage another
batch ahead when staggered; and, when drawn, a frozen one-stage program in the step whose micro-batches'
outputs each group of micro-batches' loss gathers (a batch's statistic). The plan comes from the
case's drawn costs. First, tensors of every kind cross in their envelopes (`hp.mpmd.mailbox`). Over two steps (the second uses what the reference computed ahead in the first),
each step's loss and every gradient (summed over the ranks that hold a copy) equal the plain step's
over the same batch (fp32, relative 1e-5). Every check raises on failure.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from hp.mpmd.costs import Costs
from hp.mpmd.graph import Flow, Graph, Program
from hp.mpmd.mailbox import INLINE, Mailbox
from hp.mpmd.runtime import Runtime, step_loss
from hp.mpmd.schedule import schedule

ROWS = 2  # per micro-batch


def modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    made = {"enc": nn.Linear(4, 6), "lm0": nn.Linear(6, 6), "lm1": nn.Linear(6, 3),
            "ref0": nn.Linear(4, 6), "ref1": nn.Linear(6, 3)}
    for name in ("ref0", "ref1"):
        made[name].requires_grad_(False)
    return made


def rows(batch: torch.Tensor, m: int) -> torch.Tensor:
    return batch[m * ROWS:(m + 1) * ROWS]


def loss_of(out: torch.Tensor, ref: torch.Tensor, stats: torch.Tensor | None) -> torch.Tensor:
    gathered = 0.0 if stats is None else stats.mean() * out.mean()
    return ((out - ref) ** 2).mean() + out.sum() / 7 + gathered


def statistic(batch: torch.Tensor, m: int) -> torch.Tensor:
    return rows(batch, m).sum().view(1)


def group_of(micro: int) -> int:
    """How many micro-batches a gathered statistic spans."""
    return micro // 2 if micro % 2 == 0 else micro


def plain(mods: dict[str, nn.Module], batch: torch.Tensor, micro: int, stat: bool) -> torch.Tensor:
    total, group = torch.zeros(()), group_of(micro)
    for m in range(micro):
        x = rows(batch, m)
        ref = mods["ref1"](torch.tanh(mods["ref0"](x)))
        first = m // group * group
        stats = torch.cat([statistic(batch, k) for k in range(first, first + group)]) if stat else None
        total = total + loss_of(mods["lm1"](torch.tanh(mods["lm0"](mods["enc"](x)))), ref, stats)
    return total


def piece(batch: torch.Tensor, m: int, parts: int) -> torch.Tensor:
    """Piece m % parts of micro-batch m // parts (its rows cut evenly)."""
    whole, size = rows(batch, m // parts), ROWS // parts
    return whole[(m % parts) * size:(m % parts + 1) * size]


def stages(mods: dict[str, nn.Module], parts: int, ref_parts: int, stat: bool) -> dict:
    return {  # the last stage's inputs: the stream, the gathered statistics (when drawn), the reference's
        ("enc", 0): lambda batch, m, inputs: mods["enc"](piece(batch, m, parts)),
        ("lm", 0): lambda batch, m, inputs: torch.tanh(mods["lm0"](inputs[0])),
        ("lm", 1): lambda batch, m, inputs: loss_of(mods["lm1"](inputs[0]), inputs[-1], inputs[1] if stat else None),
        ("stat", 0): lambda batch, m, inputs: statistic(batch, m),
        ("ref", 0): lambda batch, m, inputs: torch.tanh(mods["ref0"](piece(batch, m, ref_parts))),
        ("ref", 1): lambda batch, m, inputs: mods["ref1"](inputs[0]),
    }


def check(case: dict) -> None:
    micro = case["micro"]
    frozen = case["frozen_enc"]  # then it runs a batch ahead
    enc = Program("enc", tuple(case["enc"]), spread=len(case["enc"]) > 1, parts=case["parts"], trains=not frozen,
                  ahead=int(frozen))
    stat = case["stat"] is not None
    programs = (enc, Program("lm", tuple(case["lm"]), split=case["split"]),
                Program("ref", tuple(case["ref"]), trains=False, ahead=case["ahead"], parts=case["ref_parts"],
                        stagger=case["stagger"]))
    flows = (Flow(("enc", 0), ("lm", 0)),)
    if stat:  # before the reference's flow: the last stage's inputs are the stream, the statistics, the reference's
        programs += (Program("stat", (case["stat"],), trains=False),)
        flows += (Flow(("stat", 0), ("lm", 1), gather=group_of(micro)),)
    graph = Graph(programs, (*flows, Flow(("ref", 1), ("lm", 1))), micro)
    drawn = dict(zip([(k, n) for n in graph.nodes() for k in "FB"], case["seconds"]))
    costs = Costs(drawn | {("W", n): drawn["B", n] / 2 for n in graph.nodes() if graph.splits(n)}, {})
    plan = schedule(graph, costs)
    mods, want_mods = modules(), modules()
    for m in (mods, want_mods):
        m["enc"].requires_grad_(not frozen)
    replanned = Costs(dict(zip(costs.compute, reversed(costs.compute.values()))), {})  # another order, other ranks
    runtime = Runtime(plan, stages(mods, case["parts"], case["ref_parts"], stat))
    g = torch.Generator().manual_seed(case["seed"])
    batches = [torch.randn(micro * ROWS, 4, generator=g) for _ in range(4)]
    for step in range(2):
        for module in (*mods.values(), *want_mods.values()):
            module.zero_grad(set_to_none=True)
        want = plain(want_mods, batches[step], micro, stat)
        want.backward()
        losses = runtime.step(batches[step], *batches[step + 1:step + 1 + graph.furthest_ahead])
        got = step_loss(losses)
        assert torch.allclose(got, want, rtol=1e-5), (case, step, got, want)
        if step == 0:
            runtime.replan(schedule(graph, replanned))  # what ran ahead is received from where it was sent
        for name in ("lm0", "lm1") if frozen else ("enc", "lm0", "lm1"):
            for p, q in zip(mods[name].parameters(), want_mods[name].parameters()):
                grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)  # each copy of a spread program holds its micro-batches' part
                assert torch.allclose(grad, q.grad, rtol=1e-5, atol=1e-7), (case, step, name)
    if dist.get_rank() == 0:
        print(f"case {case['seed']}: {plan}".replace("\n", " | "), flush=True)


def mailbox_round_trip() -> None:
    """Tensors of every kind the runtime moves, inside their envelope or after it, cross both ways intact,
    their receives posted before they are sent (out of order) or when they are read, opened between reads
    or when read."""
    draw = torch.Generator().manual_seed(0)  # the same tensors on both ranks
    made = [torch.randn((), generator=draw), torch.arange(6, dtype=torch.int64).view(2, 3),
            torch.rand(3, 4, generator=draw) > 0.5, torch.randn(5, 7, generator=draw).bfloat16(),
            torch.randn(INLINE // 4, generator=draw), torch.randn(INLINE // 4 + 1, generator=draw),
            torch.randn(3, 33, 65, generator=draw).transpose(0, 2)]  # not contiguous, over the envelope
    box, rank = Mailbox(None, "cpu"), dist.get_rank()
    for sender in (0, 1):
        if rank == sender:
            works = [w for k, t in enumerate(made) for w in box.send(t, 1 - sender, 10 * k)]
            for work in works:
                work.wait()
        else:
            for k in range(0, len(made), 2):
                box.expect(sender, 10 * k)
            for k, tensor in reversed(list(enumerate(made))):
                box.progress()  # what has landed opened (its data's receive posted) before it is read
                got = box.take(sender, 10 * k)
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (k, got, tensor)
            assert box.pending == 0


def main() -> None:
    dist.init_process_group("gloo")
    mailbox_round_trip()
    for case in json.loads(sys.argv[1]):
        check(case)
    print("mpmd plans follow the plain step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

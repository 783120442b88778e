"""Where a frozen reference runs, chosen from measured costs: in its policy's bubbles, or on ranks of its own.

With `world` ranks, a policy and its frozen reference (`hp.mpmd.reference`)
can share them two ways:

- `shared`: the policy cut into `world` stages and the reference into as
  many on the same ranks, its forwards in the policy's bubbles;
- `own`: the policy cut into `world / 2` stages and the reference into as
  many on the other half, which run nothing else.

More stages shorten each stage's work but lengthen the pipeline's fill and
drain and put a transfer between every two; ranks of its own sit idle once
the reference is done. Which is faster depends on the model's per-block
costs, the link and the micro-batches, so `choose_reference` makes each
candidate's cost table from one block's measured costs (`BlockCosts`,
`block_costs` measures them on the model before it is cut), plans it
(`hp.mpmd.schedule`) and replays the plan (`hp.mpmd.simulate`): the shorter
step wins.

>>> cheap_link = BlockCosts(forward=1.0, backward=2.0, reference=1.0, transfer=0.0)
>>> choose_reference(cheap_link, world=4, blocks=8, microbatches=8)
ReferenceChoice(where='shared', steps={'shared': 66.0, 'own': 108.0})
>>> slow_link = BlockCosts(forward=1.0, backward=2.0, reference=1.0, transfer=30.0)
>>> choose_reference(slow_link, world=4, blocks=8, microbatches=2).where
'own'
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hp.mpmd.costs import Costs
from hp.mpmd.graph import Graph
from hp.mpmd.measure import link
from hp.mpmd.programs import even_split
from hp.mpmd.reference import pair_graph, sequence_logps
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import simulate
from hp.parallel.model_plan import ModelPlan

SHARED, OWN = "shared", "own"


@dataclass(frozen=True)
class BlockCosts:
    """Seconds per micro-batch: one block's `forward` and `backward` (the policy's), one block's
    `reference` forward (no gradient), the residual stream's `transfer` between two stages, and the
    `latency` of a small message (the reference's log-probabilities reaching the policy)."""

    forward: float
    backward: float
    reference: float
    transfer: float
    latency: float = 0.0


@dataclass(frozen=True)
class ReferenceChoice:
    """The faster candidate (`where`: "shared" or "own") and each candidate's predicted step."""

    where: str
    steps: dict[str, float]

    def ranks(self, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the policy's ranks, the reference's), one stage each."""
        return _candidates(world)[self.where]


def _candidates(world: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    found = {SHARED: (tuple(range(world)), tuple(range(world)))}
    if world % 2 == 0:
        half = world // 2
        found[OWN] = (tuple(range(half)), tuple(range(half, world)))
    return found


def pair_costs(graph: Graph, split: tuple[int, ...], costs: BlockCosts) -> Costs:
    """The cost table of `graph` (`pair_graph`) whose stages hold `split` blocks each."""
    compute, transfer = {}, {}
    for s, blocks in enumerate(split):
        compute["F", ("policy", s)] = blocks * costs.forward
        compute["B", ("policy", s)] = blocks * costs.backward
        compute["F", ("reference", s)] = blocks * costs.reference
        for program in ("policy", "reference"):
            if s + 1 < len(split):
                transfer[(program, s), (program, s + 1)] = costs.transfer
    last = len(split) - 1
    transfer[("reference", last), ("policy", last)] = costs.latency
    return Costs(compute, transfer)


def choose_reference(costs: BlockCosts, *, world: int, blocks: int, microbatches: int) -> ReferenceChoice:
    """The faster way for a policy of `blocks` blocks and its reference to share `world` ranks (see the
    module); `own` is a candidate when `world` is even, `shared` always."""
    steps = {}
    for name, (policy, reference) in _candidates(world).items():
        if blocks < len(policy):
            continue  # fewer blocks than stages: that cut cannot be made
        graph = pair_graph(policy, reference, microbatches)
        table = pair_costs(graph, even_split(blocks, len(policy)), costs)
        steps[name] = round(simulate(schedule(graph, table), table).step_seconds, 9)
    if not steps:
        raise ValueError(f"{blocks} blocks cannot be cut into a stage for each of {world // 2} ranks")
    return ReferenceChoice(min(steps, key=steps.get), steps)


def block_costs(model: nn.Module, plan: ModelPlan, tokens: int, *, rounds: int = 3, group=None) -> BlockCosts:
    """One block's costs on `model` (whole, before it is cut) for a pair of `tokens`-token rows: the model's
    forward and backward over its blocks, and its forward without gradient, each the median of `rounds`
    after a first dropped, the largest over `group`'s ranks (every rank gets the same); the stream's
    transfer over the link measured between two of them (none without a group: this process alone). In
    eval mode, so that no dropout draws from the run's generators."""
    blocks = len(model.get_submodule(plan.blocks))
    embedding = model.get_input_embeddings()
    device, width = embedding.weight.device, embedding.embedding_dim
    ids = torch.randint(0, embedding.num_embeddings, (2, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    timed: dict[str, list[float]] = {"forward": [], "backward": [], "reference": []}
    training = model.training
    model.eval()
    for r in range(rounds + 1):
        start = time.perf_counter()
        loss = sequence_logps(model(input_ids=ids, use_cache=False).logits, ids).sum()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        if r:
            timed["forward"].append(middle - start)
            timed["backward"].append(end - middle)
            timed["reference"].append(time.perf_counter() - end)
    model.zero_grad(set_to_none=True)
    model.train(training)
    measured = torch.tensor([statistics.median(v) / blocks for v in timed.values()], dtype=torch.float64, device=device)
    latency, bandwidth = 0.0, float("inf")
    if group is not None:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
        latency, bandwidth = link(group, device=device)
    stream = 2 * tokens * width * embedding.weight.element_size()
    forward, backward, reference = measured.tolist()
    return BlockCosts(forward, backward, reference, latency + stream / bandwidth, latency)

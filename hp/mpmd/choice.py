"""Where a placed program runs, chosen from measured costs: in the bubbles of the pipeline it feeds, or on ranks of its own.

With `world` ranks, a pipeline and the program placed beside it can share
them two ways:

- `shared`: the pipeline cut into `world` stages and the placed program on
  the same ranks, its work in the pipeline's bubbles;
- `own N`: the pipeline cut into `world - N` stages and the placed program
  on the other N ranks, which run nothing else (a frozen reference takes
  half the ranks, cut into the policy's stages: `own`).

More stages shorten each stage's work but lengthen the pipeline's fill and
drain and put a transfer between every two; ranks of their own sit idle
once their program is done. Which is faster depends on the model's costs,
the link and the micro-batches, so each candidate's cost table is made from
costs measured on the model before it is cut (`block_costs` for a policy
and its reference, `tower_costs` for a vision-language model), planned
(`hp.mpmd.schedule`) and replayed (`hp.mpmd.simulate`): the shorter step
wins.

>>> cheap_link = BlockCosts(forward=1.0, backward=2.0, reference=1.0, transfer=0.0)
>>> choose_reference(cheap_link, world=4, blocks=8, microbatches=8).steps
{'shared': 66.0, 'own': 108.0}
>>> slow_link = BlockCosts(forward=1.0, backward=2.0, reference=1.0, transfer=30.0)
>>> choose_reference(slow_link, world=4, blocks=8, microbatches=2).where
'own'
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hp.mpmd.clock import settle
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Graph
from hp.mpmd.layout import sequence_logps
from hp.mpmd.measure import link
from hp.mpmd.programs import even_split, sample, tower_graph, with_positions
from hp.mpmd.reference import pair_graph
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import simulate
from hp.parallel.model_plan import ModelPlan

SHARED, OWN = "shared", "own"

Ranks = tuple[tuple[int, ...], tuple[int, ...]]  # (the pipeline's ranks, the placed program's)


@dataclass(frozen=True)
class Choice:
    """The faster candidate (`where`), each candidate's predicted step, and the chosen ranks."""

    where: str
    steps: dict[str, float]
    ranks: Ranks


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
class TowerCosts:
    """Seconds per sample: a language-model block's `forward` and `backward`, the vision tower's
    `tower_forward` and `tower_backward` (none when frozen), the residual stream's `transfer` between two
    stages and the image features' `features` from the tower to the first stage."""

    forward: float
    backward: float
    tower_forward: float
    tower_backward: float
    transfer: float
    features: float = 0.0


def _fastest(candidates: dict[str, tuple[Ranks, Graph, Costs]]) -> Choice:
    steps = {name: round(simulate(schedule(graph, table), table).step_seconds, 9)
             for name, (_, graph, table) in candidates.items()}
    where = min(steps, key=steps.get)
    return Choice(where, steps, candidates[where][0])


def _pipeline(compute: dict, transfer: dict, program: str, split: tuple[int, ...], forward: float, backward: float,
              moving: float) -> None:
    """`program`'s stages of `split` blocks each into a cost table's `compute` and `transfer`."""
    for s, blocks in enumerate(split):
        compute["F", (program, s)] = blocks * forward
        compute["B", (program, s)] = blocks * backward
        if s + 1 < len(split):
            transfer[(program, s), (program, s + 1)] = moving


def _halved(compute: dict, graph: Graph) -> dict:
    """`compute` for `graph`, each split backward (`Program(split=True)`) cut into its two
    halves, its input's gradient and its weight's, of equal cost (a linear layer's two products)."""
    table = dict(compute)
    for node in graph.nodes():
        if graph.splits(node):
            table["B", node] = table["W", node] = compute["B", node] / 2
    return table


def choose_reference(costs: BlockCosts, *, world: int, blocks: int, microbatches: int,
                     reference_point: int = 0, zero_bubble: bool = False) -> Choice:
    """The faster way for a policy of `blocks` blocks and its frozen reference to share `world` ranks: `shared`
    (the policy over every rank, the reference in its bubbles) or `own` (when `world` is even: the policy
    over half, the reference on the other half). With `reference_point` (KTO, `hp.mpmd.reference`) the
    policy trains on one row of each micro-batch's two and runs the other without gradient: each half a
    pair's cost. `zero_bubble`: each way planned with the policy's backward split, as it will run."""
    ways = {SHARED: (tuple(range(world)), tuple(range(world)))}
    if world % 2 == 0:
        ways[OWN] = (tuple(range(world // 2)), tuple(range(world // 2, world)))
    candidates = {}
    for name, (policy, reference) in ways.items():
        if blocks < len(policy):
            continue  # fewer blocks than stages: that cut cannot be made
        split = even_split(blocks, len(policy))
        compute, transfer = {}, {}
        share = 0.5 if reference_point else 1.0  # of a pair's rows, what the policy's programs each run
        _pipeline(compute, transfer, "policy", split, share * costs.forward, share * costs.backward, costs.transfer)
        _pipeline(compute, transfer, "reference", split, costs.reference, 0.0, costs.transfer)
        last = len(split) - 1
        transfer[("reference", last), ("policy", last)] = costs.latency
        if reference_point:
            _pipeline(compute, transfer, "kl", split, share * costs.reference, 0.0, costs.transfer)
            transfer[("reference", last), ("kl", last)] = transfer[("kl", last), ("policy", last)] = costs.latency
        graph = pair_graph(policy, reference, microbatches, reference_point=reference_point, zero_bubble=zero_bubble)
        candidates[name] = ((policy, reference), graph, Costs(_halved(compute, graph), transfer))
    if not candidates:
        raise ValueError(f"{blocks} blocks cannot be cut into a stage for each of {world // 2} ranks")
    return _fastest(candidates)


def choose_tower(costs: TowerCosts, *, world: int, blocks: int, microbatches: int, trains: bool,
                 zero_bubble: bool = False) -> Choice:
    """The faster way for a vision tower and a language model of `blocks` blocks to share `world` ranks:
    `shared` (the language model over every rank, the tower spread over them in its bubbles) or `own N`
    (the language model over `world - N` ranks, the tower on the other N). `zero_bubble`: each way planned
    with the language model's backward split, as it will run.

    >>> costs = TowerCosts(forward=1.0, backward=2.0, tower_forward=3.0, tower_backward=6.0, transfer=0.0)
    >>> choice = choose_tower(costs, world=4, blocks=16, microbatches=8, trains=True)
    >>> choice.where, choice.ranks
    ('shared', ((0, 1, 2, 3), (0, 1, 2, 3)))
    """
    candidates = {}
    for own in range(world):
        stages = world - own
        if blocks < stages:
            continue
        split = even_split(blocks, stages)
        ranks = (tuple(range(stages)), tuple(range(world)) if own == 0 else tuple(range(stages, world)))
        compute = {("F", ("vision", 0)): costs.tower_forward, ("B", ("vision", 0)): costs.tower_backward}
        transfer = {(("vision", 0), ("language", 0)): costs.features}
        _pipeline(compute, transfer, "language", split, costs.forward, costs.backward, costs.transfer)
        graph = tower_graph(ranks[1], ranks[0], microbatches, trains, zero_bubble)
        candidates[SHARED if own == 0 else f"{OWN} {own}"] = (ranks, graph, Costs(_halved(compute, graph), transfer))
    return _fastest(candidates)


# ---- measuring the model before it is cut ------------------------------------------------------------------


def _timed(passes: dict[str, Callable[[], None]], rounds: int, device) -> dict[str, float]:
    """Each pass's median seconds over `rounds` runs after a first dropped (first touches), its work on
    `device` waited for (`hp.mpmd.clock`); they run in order, round after round, so a pass may use what the
    one before it made."""
    timed: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds + 1):
        for name, run in passes.items():
            settle(device)
            start = time.perf_counter()
            run()
            settle(device)
            if r:
                timed[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in timed.items()}


def _agreed(values: list[float], device, group) -> list[float]:
    """`values`, the largest over `group`'s ranks (every rank gets the same); as they are without a group."""
    if group is None:
        return values
    found = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found.tolist()


def _seconds_per_byte(group, device) -> tuple[float, float]:
    """(latency, seconds per byte) between two of `group`'s ranks; none without a group (one process)."""
    if group is None:
        return 0.0, 0.0
    latency, bandwidth = link(group, device=device)
    return latency, 1 / bandwidth


class _Measuring:
    """The model in eval mode while it is measured (no dropout draws from the run's generators), its
    gradients cleared after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.training = model, model.training

    def __enter__(self) -> nn.Module:
        return self.model.eval()

    def __exit__(self, *exc) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model.train(self.training)


def block_costs(model: nn.Module, plan: ModelPlan, tokens: int, *, rounds: int = 3, group=None) -> BlockCosts:
    """One block's costs on `model` (whole, before it is cut) for a pair of `tokens`-token rows: the model's
    forward and backward over its blocks, and its forward without gradient, the largest over `group`'s
    ranks; the stream's transfer over the link measured between two of them (none without a group)."""
    blocks = len(model.get_submodule(plan.blocks))
    embedding = model.get_input_embeddings()
    device = embedding.weight.device
    ids = torch.randint(0, embedding.num_embeddings, (2, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    held: list[torch.Tensor] = []
    with _Measuring(model):
        seconds = _timed({"forward": lambda: held.append(sequence_logps(model(input_ids=ids, use_cache=False).logits,
                                                                             ids).sum()),
                          "backward": lambda: held.pop().backward(),
                          "reference": lambda: _no_grad(model, input_ids=ids, use_cache=False)}, rounds, device)
    forward, backward, reference = _agreed([seconds[k] / blocks for k in ("forward", "backward", "reference")],
                                           device, group)
    latency, per_byte = _seconds_per_byte(group, device)
    stream = 2 * tokens * embedding.embedding_dim * embedding.weight.element_size()
    return BlockCosts(forward, backward, reference, latency + stream * per_byte, latency)


def tower_costs(model: nn.Module, plan: ModelPlan, batch: dict, *, rounds: int = 3, group=None) -> TowerCosts:
    """A vision-language model's costs (whole, before it is cut) on the first sample with images of `batch`
    (as `hp.mpmd.programs.vision_language` takes it): its tower's forward and (when it trains) backward, and
    a language-model block's, the whole model's less the tower's; the largest over `group`'s ranks; the
    stream's and the sample's features' transfers over the link measured between two of them."""
    batch = with_positions(model)(batch)
    start_token, image_token = model.config.vision_start_token_id, model.config.image_token_id
    images = (batch["input_ids"] == start_token).sum(-1).tolist()
    x = sample(batch, next((m for m, n in enumerate(images) if n), 0), start_token)
    tower = model.get_submodule(plan.vision)
    trains = any(p.requires_grad for p in tower.parameters())
    whole = {"input_ids": x["ids"], "labels": x["labels"], "pixel_values": x["pixels"],
             "image_grid_thw": x["grid"] if len(x["grid"]) else None, "position_ids": x["positions"], "use_cache": False}
    held: list[torch.Tensor] = []
    passes = {"model": lambda: held.append(model(**whole).loss),
              "model_backward": lambda: held.pop().backward(),
              "tower": lambda: held.append(_tower_output(tower, x, trains)),
              "tower_backward": lambda: held.pop().backward() if trains else held.pop()}
    with _Measuring(model):
        seconds = _timed(passes, rounds, model.get_input_embeddings().weight.device)
    blocks = len(model.get_submodule(plan.blocks))
    embedding = model.get_input_embeddings()
    tower_backward = seconds["tower_backward"] if trains else 0.0
    measured = [max(seconds["model"] - seconds["tower"], 0.0) / blocks,
                max(seconds["model_backward"] - tower_backward, 0.0) / blocks, seconds["tower"], tower_backward]
    forward, backward, tower_forward, tower_backward = _agreed(measured, embedding.weight.device, group)
    latency, per_byte = _seconds_per_byte(group, embedding.weight.device)
    width = embedding.embedding_dim * embedding.weight.element_size()
    features = int((x["ids"] == image_token).sum()) * width
    return TowerCosts(forward, backward, tower_forward, tower_backward,
                      latency + x["ids"].shape[1] * width * per_byte, latency + features * per_byte)


def _tower_output(tower: nn.Module, x: dict, trains: bool) -> torch.Tensor:
    if not len(x["grid"]):
        return torch.zeros((), requires_grad=trains)
    with torch.enable_grad() if trains else torch.no_grad():
        return tower(x["pixels"], grid_thw=x["grid"]).pooler_output.float().square().mean()


def _no_grad(model: nn.Module, **inputs) -> None:
    with torch.no_grad():
        model(**inputs)

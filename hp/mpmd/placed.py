"""`hp.mpmd(model, place=..., mesh=...)`: a model's sub-models on sub-meshes of their own, as one training step.

Levels 2 and 3 as a transform: the caller names where each sub-model runs,
and gets back a step that runs forward and backward of the whole batch
(micro-batch by micro-batch, each rank its own list of actions), whose
order is planned from what the step itself measured:

1. the first `warmup` steps run the plan made in unit time (every forward
   1, every backward 2: what PyTorch's schedules assume); the first step's
   timings are dropped (first touches);
2. after them every rank's timings are gathered and the link between two
   ranks is measured (`hp.mpmd.measure`), the cost table is built and the
   step is planned again from it (`hp.mpmd.schedule`); every rank plans
   from the same table, so every rank holds the same plan;
3. every later step runs that plan; `simulation()` replays it with the
   table (its predicted step, each rank's idle share, a timeline to draw).

A step returns the batch's loss on every rank. Each rank then holds the
gradients of the stages it ran (`parameters()`, each once): a program
spread over several ranks (a vision tower held whole on each) has its
gradients summed over them inside the step, as data parallel's, so the
caller's optimizer steps over `parameters()` as it would over the model's.
`evaluate(batch)` runs a held-out batch forward only through the same
stages, every program in the step.

**Data parallel replicas.** `Placed(programs, replicas=dp)` runs the step
on `dp` blocks of the group's ranks, in order, each block a replica of the
whole placement (the graph's ranks are block-local) fed its own share of
the data: every stage is laid out with data parallel over the ranks
holding it in each replica. After the step each gradient is summed over
the replicas and the loss is the replicas' sum, so the caller divides each
micro-batch's loss by the whole batch's count, as one replica would.

**Tensor parallel planes.** `Placed(programs, planes=tp)` runs the
placement on `tp` planes: graph rank r of plane j is global rank
`r * tp + j` (in each replica: the planes innermost, as tp is a mesh's
innermost axis), each plane runs the same plan, and the `tp` ranks of one
graph rank hold one stage laid out over them (build the programs with
`strategy=`, `mesh=` that tensor parallel group's mesh): each plane sends
its own block of the stream to its counterpart, and DTensor's collectives
run across the planes inside each action. The loss is each plane's (the
same in all). `hp.mpmd(model, place=..., mesh=..., strategy=hp.Strategy(tp=2))`
does this for the step transform, `mesh` naming each plane's ranks.

**Named sub-meshes.** `mesh` maps names to tuples of global ranks:
`{"enc": (0, 1), "pp": (0, 1)}`. The model's remainder (its language
model) is cut into one pipeline stage per rank of `mesh["pp"]`;
`place={"model.visual": "enc"}` spreads the vision tower over `mesh["enc"]`.
Sub-meshes may share ranks: a tower on the pipeline's own ranks runs in its
bubbles; a tower on ranks of its own sends its features to the first stage
(and gets their gradients back).

>>> # two ranks; see docs/mpmd.md for the runnable example
>>> # step = hp.mpmd(model, place={"model.visual": "enc"}, mesh={"enc": (0, 1), "pp": (0, 1)},
>>> #                plan=plan_for(model.config), microbatches=4)
>>> # loss = step(batch); torch.optim.SGD(step.parameters(), lr=0.1).step()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp.mesh import mesh as make_mesh
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Graph
from hp.mpmd.grid import Grid, replica_of
from hp.mpmd.mailbox import CHANNEL_BACKEND
from hp.mpmd.measure import gathered_costs, link
from hp.mpmd.plan import Plan
from hp.mpmd.programs import Programs, vision_language
from hp.mpmd.runtime import Runtime, members, step_loss
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import Simulation, simulate
from hp.parallel.model_plan import ModelPlan
from hp.parallel.strategy import DEFAULTS, PLACED_AXIS, Strategy

PIPELINE = "pp"  # the sub-mesh the model's remainder is cut into stages over


class PlaceError(ValueError):
    """A placement that cannot run: a sub-model hp.mpmd cannot place, an unknown or bad sub-mesh."""


class Placed:
    """A training step over `programs` (`hp.mpmd.programs`), planned again from its measured costs after
    `warmup` steps (see the module). Every rank of `group` (default: the world) calls it."""

    def __init__(self, programs: Programs, *, warmup: int = 3, group: Any = None, replicas: int = 1,
                 planes: int = 1) -> None:
        if warmup < 2:
            raise PlaceError(f"warmup = {warmup}: the first step's timings are dropped, so at least 2 steps")
        self.programs, self.graph, self.warmup, self.replicas = programs, programs.graph, warmup, replicas
        world = dist.get_world_size(group)
        if replicas < 1 or planes < 1 or world % (replicas * planes):
            raise PlaceError(f"replicas = {replicas}, planes = {planes}: the group's {world} ranks do not cut into "
                             "that many blocks")
        self.grid = Grid(tuple(members(group)), replicas, planes)
        if self.graph.world > self.grid.width:
            raise PlaceError(f"the placement uses ranks up to {self.graph.world - 1}; each of the {replicas} "
                             f"replicas has {self.grid.width} in each of its {planes} planes")
        self.group = group if replicas == planes == 1 else self.grid.group()  # this rank's replica's plane
        self.rank = self.grid.where(dist.get_rank())[1]
        device = next((p.device for m in programs.modules.values() for p in m.parameters()), torch.device("cpu"))
        self.runtime = Runtime(schedule(self.graph, Costs.unit(self.graph)), programs.stages, group=self.group,
                               device=device, channel=self.grid.group(backend=CHANNEL_BACKEND))
        self.costs: Costs | None = None
        self._spread = {p.name: self.grid.group(p.ranks) for p in self.graph.programs
                        if p.spread and p.trains and len(p.ranks) > 1}  # where its gradients are summed
        self._tied_group = self._tied_copies_group()  # a head tied to the embedding, in two stages' ranks
        self._across = self.grid.across()  # this rank's stage in every replica: data parallel's group
        self._planes = self.grid.across_planes()  # this rank's stage in every plane: its tensor parallel group
        self._evaluators: dict[int, Runtime] = {}  # forward-only runtimes, by micro-batches

    @property
    def plan(self) -> Plan:
        return self.runtime.plan

    def __call__(self, batch: Any, *upcoming: Any) -> torch.Tensor:
        """Forward and backward of `batch` (this replica's share); the loss, summed over the replicas.
        `upcoming`: the batches after it, as many as the programs run ahead (`graph.furthest_ahead`; fewer at
        the end of the data)."""
        prepare = self.programs.prepare
        params = self.parameters()
        before = {id(p): p.grad for p in params if p.grad is not None}  # summed over ranks once: this step's apart
        for p in params:
            p.grad = None
        losses = self.runtime.step(prepare(batch), *(None if b is None else prepare(b) for b in upcoming))
        for name, spread in self._spread_parameters().items():
            _sum_gradients(spread, self._spread[name])
        self._sum_tied_copies()
        if self._across is not None:
            _sum_gradients(params, self._across)
        for p in params:
            if id(p) in before:
                p.grad = before[id(p)] if p.grad is None else p.grad + before[id(p)]
        loss = step_loss(losses, self.group, self.runtime.device)
        if self._across is not None:
            dist.all_reduce(loss, group=self._across)
        if self.runtime.steps == 1:  # first touches: not a cost to plan by
            self.runtime.samples.clear()
            self.runtime.transfers.clear()
        elif self.runtime.steps == self.warmup:
            self.costs = self._agreed(gathered_costs(self.runtime, *link(self.group, device=self.runtime.device),
                                                     group=self.group))
            self.runtime.replan(schedule(self.graph, self.costs))
            self.runtime.measuring = False  # planned: the device's queue need not drain after each action
        return loss

    def _agreed(self, costs: Costs) -> Costs:
        """The first plane's cost table on every plane: the planes run one plan, their collectives in step."""
        if self._planes is None:
            return costs
        box = [costs]
        dist.broadcast_object_list(box, dist.get_process_group_ranks(self._planes)[0], group=self._planes)
        return box[0]

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The loss of `batch` (one micro-batch per sample: `len(batch["input_ids"])`), forward only, every
        program in the step (none ahead); every replica evaluates the whole batch alike. Every rank calls it."""
        micro = len(batch["input_ids"])
        if micro not in self._evaluators:
            graph = Graph(tuple(dataclasses.replace(p, trains=False, ahead=0, stagger=False, split=False)
                                for p in self.graph.programs), self.graph.flows, micro)
            runtime = Runtime(schedule(graph, Costs.unit(graph)), self.programs.stages, group=self.group,
                              device=self.runtime.device, channel=self.grid.group(backend=CHANNEL_BACKEND))
            runtime.measuring = False
            self._evaluators[micro] = runtime
        runtime = self._evaluators[micro]
        losses = runtime.step(self.programs.prepare(batch))
        runtime.samples.clear()
        runtime.transfers.clear()
        return step_loss(losses, self.group, self.runtime.device)

    def parameters(self) -> list[nn.Parameter]:
        """The trained parameters of the stages this rank runs, each once."""
        seen: dict[int, nn.Parameter] = {}
        for node, module in self.programs.modules.items():
            if self.graph.trains(node) and self.rank in self.graph.ranks_of(node):
                seen.update((id(p), p) for p in module.parameters() if p.requires_grad)
        return list(seen.values())

    def counted_parameters(self) -> list[nn.Parameter]:
        """`parameters()`, less those of a program held whole on several ranks but the first of them: over
        every rank, each parameter once (what a global gradient norm sums)."""
        elsewhere = {id(p) for name, params in self._spread_parameters().items()
                     if self.rank != self.graph.program[name].ranks[0] for p in params}
        head = self._tied_copies()[1]  # the last stage's copy of a tied head: the first stage's counts
        if head is not None:
            elsewhere.add(id(head))
        return [p for p in self.parameters() if id(p) not in elsewhere]

    def _tied_copies(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """The trained copies this rank holds of a head tied to its embedding (`Programs.tied`), the first
        stage's and the last's (None where it holds none; both None when one stage holds the weight once)."""
        if self.programs.tied is None:
            return None, None
        name, embedding, head = self.programs.tied
        last = len(self.graph.program[name].ranks) - 1
        if last == 0:
            return None, None
        held = [self.programs.modules[name, s].get_parameter(weight) if (name, s) in self.programs.modules else None
                for s, weight in ((0, embedding), (last, head))]
        return tuple(p if p is not None and p.requires_grad else None for p in held)

    def _tied_copies_group(self) -> Any:
        """The group of the ranks of the first and the last stage holding a tied head's copies (None: none, or
        one rank holding both); every rank makes it (a collective)."""
        if self.programs.tied is None:
            return None
        ranks = self.graph.program[self.programs.tied[0]].ranks
        return self.grid.group((ranks[0], ranks[-1])) if ranks[0] != ranks[-1] else None

    def _sum_tied_copies(self) -> None:
        """Each copy of a tied head's weight gets the gradient of both (as one weight gets on one device)."""
        copies = [p for p in self._tied_copies() if p is not None]
        if len(copies) == 2:  # both stages on this rank
            total = copies[0].grad + copies[1].grad
            for p in copies:
                p.grad = total.clone()
        elif copies and self._tied_group is not None:
            _sum_gradients(copies, self._tied_group)

    def simulation(self) -> Simulation:
        """The plan replayed with the measured cost table (once planned from it)."""
        if self.costs is None:
            raise PlaceError(f"no cost table yet: the step plans from its costs after {self.warmup} steps")
        return simulate(self.plan, self.costs)

    def _spread_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The trained parameters of each program held whole on several ranks, where this rank holds it."""
        return {name: [p for p in self.programs.modules[name, 0].parameters() if p.requires_grad]
                for name in self._spread if self.rank in self.graph.program[name].ranks}



def _sum_gradients(params: list[nn.Parameter], group: Any) -> None:
    """`params`' gradients summed over `group`, one flat all-reduce per dtype (a rank that ran none of a
    parameter's work adds zeros); a laid-out gradient's own block."""
    for dtype in sorted({p.dtype for p in params}, key=str):  # the same order on every rank
        same = [p for p in params if p.dtype == dtype]
        for p in same:
            p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
        blocks = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in same]
        flat = torch.cat([b.reshape(-1) for b in blocks])
        dist.all_reduce(flat, group=group)
        for block, summed in zip(blocks, flat.split([b.numel() for b in blocks])):
            block.copy_(summed.view_as(block))


def placed(model: nn.Module, place: Mapping[str, str], mesh: Mapping[str, Sequence[int]], *, plan: ModelPlan | None,
           microbatches: int | None, warmup: int = 3, split: tuple[int, ...] | None = None,
           strategy: Strategy | None = None, zero_bubble: bool = False) -> Placed:
    """`model`'s sub-models placed on `mesh`'s named sub-meshes (see the module), checked before any rank works;
    `strategy` (tp, sp): each stage laid out over tp ranks, the world tp planes of `mesh`'s ranks;
    `zero_bubble`: the language model's stages split their backward (`hp.mpmd.backward`)."""
    if plan is None:
        raise PlaceError("place needs the model's plan (plan=hp.models.plan_for(model.config)): it names the "
                         "sub-models and the blocks the pipeline is cut along")
    if not microbatches or microbatches < 1:
        raise PlaceError(f"microbatches = {microbatches!r}: expected the samples of a step's batch (one "
                         "micro-batch each), at least 1")
    planes = _planes(strategy)
    submeshes = _submeshes(mesh, planes)
    placeable = {plan.vision: "the vision tower"} if plan.vision else {}
    for path, where in place.items():
        if path not in placeable:
            can = ", ".join(f"{p!r} ({what})" for p, what in placeable.items()) or "none"
            raise PlaceError(f"place: {path!r} is no sub-model hp.mpmd can place; this model's are: {can}")
        if where not in submeshes:
            raise PlaceError(f"place: {path!r} -> {where!r}: no sub-mesh of that name; mesh names "
                             f"{sorted(submeshes)}")
    if PIPELINE not in submeshes:
        raise PlaceError(f"mesh: no {PIPELINE!r} sub-mesh: the model's remainder is cut into a pipeline stage per "
                         f"rank of mesh[{PIPELINE!r}]")
    tower = submeshes[place[plan.vision]] if plan.vision in place else submeshes[PIPELINE]
    rank = replica_of(1, planes=planes)[1] if dist.is_initialized() else None
    laid_out = {}
    if planes > 1:  # every rank makes the mesh: graph ranks by tp planes, tp innermost
        world = dist.get_world_size()
        laid_out = {"strategy": strategy, "mesh": make_mesh(**{PLACED_AXIS: world // planes, "tp": planes})["tp"]}
    programs = vision_language(model, plan, tower_ranks=tower, stage_ranks=submeshes[PIPELINE],
                               microbatches=microbatches, split=split, rank=rank, zero_bubble=zero_bubble,
                               **laid_out)
    return Placed(programs, warmup=warmup, planes=planes)


def _planes(strategy: Strategy | None) -> int:
    """The tensor parallel planes `strategy` lays each stage out over (tp and sp are what a placed stage takes)."""
    if strategy is None:
        return 1
    others = {k: v for k, v in strategy.as_dict().items() if k not in ("tp", "sp") and v != DEFAULTS[k]}
    if others:
        raise PlaceError(f"strategy: {others} inside placed stages; a placed stage is laid out over tp (and sp) "
                         "alone")
    return strategy.tp


def _submeshes(mesh: Mapping[str, Sequence[int]], planes: int = 1) -> dict[str, tuple[int, ...]]:
    """`mesh`'s sub-meshes as tuples of ranks, each a distinct list of ranks of each of the world's `planes`."""
    if not isinstance(mesh, Mapping) or not mesh:
        raise PlaceError(f"mesh = {mesh!r}: expected named sub-meshes, e.g. {{'enc': (0, 1), 'pp': (0, 1)}}")
    world = dist.get_world_size() // planes if dist.is_initialized() else None
    found = {}
    for name, ranks in mesh.items():
        ranks = tuple(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise PlaceError(f"mesh[{name!r}] = {ranks}: expected distinct ranks >= 0")
        if world is not None and max(ranks) >= world:
            where = "the world" if planes == 1 else f"each of the world's {planes} tensor parallel planes"
            raise PlaceError(f"mesh[{name!r}] = {ranks}: rank {max(ranks)} is outside the {world} ranks of {where}")
        found[name] = ranks
    return found

"""The programs of an MPMD step and what flows between them: the data that `hp.mpmd` schedules and runs.

A step of levels 2 and 3 is a small graph. A **program** is one model, or
one sub-model (a vision tower, a language model, a frozen reference), cut
into stages, each stage placed on one rank and run once per micro-batch. A
**flow** carries one micro-batch's tensor from a stage of one program to a
stage of another (a vision tower's features to the language model's first
stage; a reference's log-probabilities to the policy's last); between the
stages of one program the stream flows in order. A program that trains
sends the gradients of what it received back along the same flows. A
**gathering** flow carries a statistic of a group of micro-batches instead:
each micro-batch of its destination receives every micro-batch of its
group from the source (KTO's reference point, a mean over a batch's
mismatched pairs, reaching each answer's loss); its source is frozen and in
the same step, so nothing flows back. A
program may run **ahead**: its micro-batches belong to the next batch (a
frozen reference depends on nothing the policy computes, so its forward
for batch t + 1 can run during step t). A frozen program may also be
**staggered**: its stage s runs `stages - 1 - s` batches further ahead than
its last, so that no stage of it waits within a step on another (each
stage's output is received by the next stage in the next step), and every
one of its forwards can go wherever a rank is idle.

The graph's actions are each stage's forward `F` and (when it trains)
backward `B` per micro-batch; `dependencies` says what each waits for. A
program may **split** its backward, as zero-bubble pipeline schedules do:
then `B` of a stage that received trained inputs computes only their
gradients (what the stage before waits for) and `W`, its parameters'
gradients, runs later on the same rank, wherever it leaves no one waiting.
Scheduling them is `hp.mpmd.schedule`'s business, running them
`hp.mpmd.runtime`'s, replaying them against a cost table
`hp.mpmd.simulate`'s.

>>> g = Graph((Program("vision", (0,)), Program("language", (0, 1))), (Flow(("vision", 0), ("language", 0)),), 2)
>>> [str(a) for a in g.dependencies(Action("F", "language", 0, 1))]
['vision0.F1']
>>> [str(a) for a in g.dependencies(Action("B", "vision", 0, 1))]
['vision0.F1', 'language0.B1']
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

Node = tuple[str, int]  # (program, stage)


class GraphError(ValueError):
    """A graph of programs that cannot run: an unknown program or stage, a cycle, a rank out of range."""


@dataclass(frozen=True, order=True)
class Action:
    """One stage's forward (`F`), backward (`B`) or, when its program splits it, the weight gradient (`W`) of
    one micro-batch."""

    kind: str
    program: str
    stage: int
    micro: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind, self.program, self.stage, self.micro)))

    def __hash__(self) -> int:  # kept: planning hashes actions millions of times
        return self._hash

    def __reduce__(self):  # rebuilt from its fields: another process hashes strings differently
        return Action, (self.kind, self.program, self.stage, self.micro)

    @property
    def node(self) -> Node:
        return self.program, self.stage

    def __str__(self) -> str:
        return f"{self.program}{self.stage}.{self.kind}{self.micro}"


@dataclass(frozen=True)
class Program:
    """A model (or sub-model) cut into stages: stage i runs on rank `ranks[i]`.

    `trains`: it has a backward (a frozen reference does not). `ahead`: how many batches ahead its
    micro-batches run (0: this step's batch); `stagger` (frozen programs): stage s runs
    `stages - 1 - s` batches further ahead still (its stages then wait on nothing within a step).
    `spread`: one stage whose micro-batches each run on one of
    `ranks`, chosen by the scheduler (the program held whole on each of them, its gradients summed over
    them, as data parallel's): a small sub-model's work placed where the others leave gaps. `parts`:
    each of the step's micro-batches is cut into this many pieces (its rows) for this program, each run
    as a micro-batch of its own, so that the pieces of one micro-batch of a spread program run on
    several ranks at once; a program consuming them receives the pieces of its micro-batch joined.
    """

    name: str
    ranks: tuple[int, ...]
    trains: bool = True
    ahead: int = 0
    spread: bool = False
    parts: int = 1
    stagger: bool = False
    split: bool = False

    @property
    def stages(self) -> int:
        return 1 if self.spread else len(self.ranks)

    def ahead_of(self, stage: int) -> int:
        """How many batches ahead stage `stage` runs."""
        return self.ahead + (self.stages - 1 - stage if self.stagger else 0)

    @property
    def runs_ahead(self) -> bool:
        """Whether any of its stages works on a later batch than the step's."""
        return self.ahead_of(0) > 0


@dataclass(frozen=True)
class Flow:
    """A micro-batch's tensor from stage `src` of one program to stage `dst` of another (its gradient back
    when both train). `gather` > 0: micro-batch m of `dst` receives, joined, every micro-batch of `src` in
    m's group of `gather` (micro-batches `m // gather * gather` on), from a frozen `src` in the same step."""

    src: Node
    dst: Node
    gather: int = 0


@dataclass(frozen=True)
class Graph:
    """Programs, the flows between them, and the step's micro-batch count."""

    programs: tuple[Program, ...]
    flows: tuple[Flow, ...]
    microbatches: int

    def __post_init__(self) -> None:
        names = [p.name for p in self.programs]
        if len(set(names)) != len(names):
            raise GraphError(f"program names repeat: {names}")
        for program in self.programs:
            if program.split and not program.trains:
                raise GraphError(f"program {program.name!r}: only a trained program's backward can be split")
            if program.stagger and program.trains:
                raise GraphError(f"program {program.name!r}: only a frozen program can be staggered (a trained "
                                 "one's gradients flow back within the step)")
        for flow in self.flows:
            for end in (flow.src, flow.dst):
                if end[0] not in self.program or not 0 <= end[1] < self.program[end[0]].stages:
                    raise GraphError(f"flow {flow.src} -> {flow.dst}: {end} is no stage of the graph")
            if self.ahead_of(flow.src) < self.ahead_of(flow.dst):
                raise GraphError(f"flow {flow.src} -> {flow.dst}: a program cannot feed one that runs further ahead")
            if flow.gather:
                self._check_gather(flow)
            src, dst = self.program[flow.src[0]].parts, self.program[flow.dst[0]].parts
            if src % dst:
                raise GraphError(f"flow {flow.src} -> {flow.dst}: parts = {src} does not cut into parts = {dst}")
        if self.microbatches < 1:
            raise GraphError(f"microbatches = {self.microbatches}: expected at least 1")
        self.order  # noqa: B018 - refuses a cycle now

    def _check_gather(self, flow: Flow) -> None:
        src, dst = self.program[flow.src[0]], self.program[flow.dst[0]]
        if src.trains or self.ahead_of(flow.src) != self.ahead_of(flow.dst) or src.parts != 1 or dst.parts != 1:
            raise GraphError(f"flow {flow.src} -> {flow.dst}: a gathering flow comes from a frozen program in the "
                             "same step, neither cut into parts (nothing flows back)")
        if self.microbatches % flow.gather:
            raise GraphError(f"flow {flow.src} -> {flow.dst}: microbatches = {self.microbatches} does not cut into "
                             f"groups of gather = {flow.gather}")

    @cached_property
    def program(self) -> dict[str, Program]:
        return {p.name: p for p in self.programs}

    @property
    def world(self) -> int:
        """How many ranks the graph's stages use (the highest rank + 1)."""
        return 1 + max(r for p in self.programs for r in p.ranks)

    def ranks_of(self, node: Node) -> tuple[int, ...]:
        """The ranks stage `node` may run on: its own, or any of a spread program's."""
        program = self.program[node[0]]
        return program.ranks if program.spread else (program.ranks[node[1]],)

    def nodes(self) -> list[Node]:
        return [(p.name, s) for p in self.programs for s in range(p.stages)]

    def ahead_of(self, node: Node) -> int:
        """How many batches ahead stage `node` runs."""
        return self.program[node[0]].ahead_of(node[1])

    def inputs(self, node: Node) -> list[Node]:
        """What stage `node` receives each micro-batch of the same batch: the stage before it, then its
        flows' sources."""
        return [src for src, dst in self._edges if dst == node and self.ahead_of(src) == self.ahead_of(dst)]

    def outputs(self, node: Node) -> list[Node]:
        """Where stage `node` sends each micro-batch for the same batch: the stage after it, then its flows'
        destinations."""
        return [dst for src, dst in self._edges if src == node and self.ahead_of(src) == self.ahead_of(dst)]

    def carried_inputs(self, node: Node) -> list[Node]:
        """What stage `node` receives from stages running further ahead: sent in an earlier step."""
        return [src for src, dst in self._edges if dst == node and self.ahead_of(src) > self.ahead_of(dst)]

    def carried_outputs(self, node: Node) -> list[Node]:
        """Where stage `node` sends what a later step receives (stages running less far ahead)."""
        return [dst for src, dst in self._edges if src == node and self.ahead_of(src) > self.ahead_of(dst)]

    @cached_property
    def _edges(self) -> tuple[tuple[Node, Node], ...]:
        """Every (src, dst) a micro-batch's tensor travels: between a program's stages in order, then the flows."""
        inside = [((p.name, s), (p.name, s + 1)) for p in self.programs for s in range(p.stages - 1)]
        return tuple(inside + [(f.src, f.dst) for f in self.flows])

    @property
    def furthest_ahead(self) -> int:
        """How many batches after the step's the furthest stage works on."""
        return max(self.ahead_of(node) for node in self.nodes())

    def trains(self, node: Node) -> bool:
        return self.program[node[0]].trains

    def splits(self, node: Node) -> bool:
        """Whether stage `node` runs its backward as `B` (its inputs' gradients) and `W` (its parameters'): its
        program splits it and it receives a trained input (else its whole backward is a weight gradient)."""
        return self.program[node[0]].split and any(self.trains(src) for src in self.inputs(node))

    def micros(self, node: Node) -> int:
        """How many micro-batches stage `node` runs a step: the step's, times its program's parts."""
        return self.microbatches * self.program[node[0]].parts

    def pieces(self, src: Node, dst: Node, m: int) -> range:
        """The micro-batches of `src` whose outputs make micro-batch `m` of `dst` (joined in this order)."""
        group = self._gathers.get((src, dst))
        if group:
            return range(m // group * group, (m // group + 1) * group)
        ratio = self.program[src[0]].parts // self.program[dst[0]].parts
        return range(m * ratio, (m + 1) * ratio)

    def consumer(self, src: Node, dst: Node, m: int) -> int:
        """The micro-batch of `dst` that micro-batch `m` of `src` is a piece of (the first, for a gathering flow)."""
        return self.consumers(src, dst, m)[0]

    def consumers(self, src: Node, dst: Node, m: int) -> range:
        """Every micro-batch of `dst` that receives micro-batch `m` of `src`: one, or a gathering flow's group."""
        group = self._gathers.get((src, dst))
        if group:
            return range(m // group * group, (m // group + 1) * group)
        first = m // (self.program[src[0]].parts // self.program[dst[0]].parts)
        return range(first, first + 1)

    @cached_property
    def _gathers(self) -> dict[tuple[Node, Node], int]:
        return {(f.src, f.dst): f.gather for f in self.flows if f.gather}

    def actions(self) -> list[Action]:
        """Every action of the step, in an order that respects its dependencies."""
        found = []
        for node in self.order:
            found += [Action("F", *node, m) for m in range(self.micros(node))]
        for node in reversed(self.order):
            if self.trains(node):
                found += [Action("B", *node, m) for m in range(self.micros(node))]
        return found + [Action("W", *node, m) for node in self.order if self.splits(node) for m in range(self.micros(node))]

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions `action` waits for (on its own rank or another)."""
        known = self._dependencies.get(action)
        return known if known is not None else tuple(self._dependencies_of(action))

    @cached_property
    def _dependencies(self) -> dict[Action, tuple[Action, ...]]:
        """Every action's dependencies, worked out once: planning asks for them millions of times."""
        return {action: tuple(self._dependencies_of(action)) for action in self.actions()}

    def _dependencies_of(self, action: Action) -> list[Action]:
        node, m = action.node, action.micro
        if action.kind == "F":
            return [Action("F", *src, piece) for src in self.inputs(node) for piece in self.pieces(src, node, m)]
        if action.kind == "W":
            return [Action("B", *node, m)]
        grads = [Action("B", *dst, self.consumer(node, dst, m)) for dst in self.outputs(node) if self.trains(dst)]
        return [Action("F", *node, m), *grads]

    @cached_property
    def order(self) -> tuple[Node, ...]:
        """The stages in an order where each comes after every stage it receives from."""
        placed: list[Node] = []
        waiting = self.nodes()
        while waiting:
            ready = [n for n in waiting if all(src in placed for src in self.inputs(n))]
            if not ready:
                raise GraphError(f"the flows make a cycle among {waiting}")
            placed += ready
            waiting = [n for n in waiting if n not in ready]
        return tuple(placed)

    def in_flight_limit(self, node: Node) -> int:
        """How many micro-batches stage `node` may hold between forward and backward (1F1B's bound: the
        trained stages from it to the end of the longest path it feeds)."""
        downstream = [self.in_flight_limit(dst) / self.program[dst[0]].parts for dst in self.outputs(node)
                      if self.trains(dst)]
        return int(self.program[node[0]].parts * (1 + max(downstream, default=0)))

"""A plan of an MPMD step: each rank's actions in the order it runs them, and how that order plays out.

The runtime runs each rank's list in order, each action as soon as its
inputs have arrived; `replay` does the same with a cost table's seconds,
which is how the scheduler compares plans and how `hp.mpmd.simulate`
projects them. A plan that deadlocks (a rank waiting on an action another
rank runs only later) is named here.

>>> from hp.mpmd.costs import Costs
>>> from hp.mpmd.graph import Action, Graph, Program
>>> graph = Graph((Program("lm", (0, 1)),), (), 1)
>>> plan = Plan(graph, {0: (Action("F", "lm", 0, 0), Action("B", "lm", 0, 0)),
...                     1: (Action("F", "lm", 1, 0), Action("B", "lm", 1, 0))})
>>> [(str(s.action), s.start) for s in replay(plan, Costs.unit(graph))]
[('lm0.F0', 0.0), ('lm1.F0', 1.0), ('lm1.B0', 2.0), ('lm0.B0', 3.0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hp.mpmd.costs import Costs
from hp.mpmd.graph import Action, Graph, GraphError


@dataclass(frozen=True)
class Plan:
    """Each rank's actions, in the order it runs them, for the step of `graph`; `where` is each action's rank."""

    graph: Graph
    actions: dict[int, tuple[Action, ...]]

    @cached_property
    def where(self) -> dict[Action, int]:
        return {a: rank for rank, acts in self.actions.items() for a in acts}

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in sorted(self.actions.items()))


@dataclass(frozen=True)
class Slot:
    """One action as it ran (or would run): its rank and its start and end, in seconds from the step's start."""

    action: Action
    rank: int
    start: float
    end: float


def ready_at(graph: Graph, costs: Costs, action: Action, rank: int, ends: dict[Action, float],
             where: dict[Action, int], dependencies: list[Action] | None = None) -> float:
    """When `action`'s inputs (`dependencies`, default all) are on `rank`: each one's end plus its transfer
    (none on one rank)."""
    waits = graph.dependencies(action) if dependencies is None else dependencies
    times = [ends[d] + (costs.moving(d.node, action.node) if where[d] != rank else 0.0) for d in waits]
    return max(times, default=0.0)


def replay(plan: Plan, costs: Costs) -> list[Slot]:
    """Every action's slot when each rank runs its list in order, each action once its inputs arrived."""
    graph = plan.graph
    ends: dict[Action, float] = {}
    free = [0.0] * graph.world
    at = dict.fromkeys(plan.actions, 0)
    slots: list[Slot] = []
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in plan.actions.items():
            while at[rank] < len(actions) and all(d in ends for d in graph.dependencies(actions[at[rank]])):
                action = actions[at[rank]]
                start = max(free[rank], ready_at(graph, costs, action, rank, ends, plan.where))
                ends[action] = free[rank] = start + costs.seconds(action)
                slots.append(Slot(action, rank, start, ends[action]))
                at[rank] += 1
                progressed = True
    stuck = [str(acts[at[r]]) for r, acts in plan.actions.items() if at[r] < len(acts)]
    if stuck:
        raise GraphError(f"the plan deadlocks: each rank waits at {', '.join(stuck)}")
    return slots

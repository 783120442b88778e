"""The order of each rank's actions in an MPMD step, chosen from a cost table.

A plan is made in passes, as a cluster's batch scheduler fills a machine:

1. **The step's own programs** by list scheduling: repeatedly, of every
   action whose inputs are scheduled, the one that can start earliest on
   its rank runs next there (a backward before a forward before a split
   backward's weight gradient, an earlier micro-batch first, then the
   longest path to the step's end). A stage holds at most
   `Graph.in_flight_limit` micro-batches between forward and backward (its
   weight gradient, when split), so a pipeline keeps 1F1B's memory, and a
   stage placed before it (a vision tower) runs ahead of it only that far.
   Split, a pipeline's drain passes its backwards up in the input
   gradients' time, and the weight gradients fill the gaps that leaves.
2. **Programs running ahead** (a frozen reference's forward of the next
   batch), and in a second candidate also the **spread** programs (a
   tower whose micro-batches may run on any of its ranks), backfill: each
   of their actions goes into the earliest idle gap that fits it on a rank
   it may run on, after its inputs arrive; what fits nowhere runs after
   the rank's last action. A gap may be overrun by a share of the
   action's length (`OVERLAPS`), each share making a candidate. A program
   cutting each micro-batch into parts may, in further candidates, keep the
   parts of one micro-batch on distinct ranks (`distinct`): a backward runs
   where its forward ran, so parts placed together early come back
   together at the step's end, where nothing else can overlap them.
3. **Each rank's order** follows the planned starts, except that a
   backfilled action runs as soon as its inputs are in (a rank must not
   wait behind work whose inputs came late).

Of the candidate plans, the one whose replay (`hp.mpmd.plan.replay`) under
the table is shortest is kept, so `hp.mpmd.simulate` gives its times.
4. **Moves.** The backfill puts a spread forward into the earliest gap,
   blind to where its backward must then go (where the forward ran), so
   the kept plan's spread micro-batches are moved, each forward with its
   backward, to another of their ranks while the replay shortens.

>>> from hp.mpmd.graph import Graph, Program
>>> plan = schedule(Graph((Program("lm", (0, 1)),), (), 2), Costs.unit(Graph((Program("lm", (0, 1)),), (), 2)))
>>> [str(a) for a in plan.actions[1]]
['lm1.F0', 'lm1.B0', 'lm1.F1', 'lm1.B1']
"""

from __future__ import annotations

from collections import Counter

from hp.mpmd.costs import Costs
from hp.mpmd.graph import Action, Graph, GraphError
from hp.mpmd.plan import Plan, ready_at, replay


def schedule(graph: Graph, costs: Costs) -> Plan:
    """The plan of `graph`'s step under `costs` (see the module's docstring): of the candidate plans, the one
    whose replay under `costs` is shortest."""
    level = _longest_path(graph, costs)
    spread = {p.name for p in graph.programs if p.spread and not p.runs_ahead}
    fills = [frozenset(), frozenset(spread)] if spread else [frozenset()]
    backfilled = any(p.runs_ahead for p in graph.programs) or spread
    parted = any(p.parts > 1 and p.spread for p in graph.programs)
    candidates = [_plan(graph, costs, level, fill, overlap) for fill in fills
                  for overlap in (OVERLAPS if backfilled else (0.0,))]
    for fill, overlap in [(f, o) for f in fills for o in OVERLAPS] if parted else []:
        try:
            candidates.append(_plan(graph, costs, level, fill, overlap, distinct=True))
        except GraphError:  # the parts pinned apart can leave a stage's in-flight limit nothing to run
            continue
    best = min(candidates, key=lambda plan: _length(plan, costs))
    return _moved(best, costs) if spread else best


def _length(plan: Plan, costs: Costs) -> float:
    return max((s.end for s in replay(plan, costs)), default=0.0)


def _moved(plan: Plan, costs: Costs, passes: int = 3) -> Plan:
    """`plan` with spread micro-batches moved, each forward with its backward (both halves, when split), to
    another of the program's ranks while the replay shortens: the backfill puts each forward into the
    earliest gap, blind to where its backward must then go. At most `passes` sweeps, each move re-ordered as the backfilled work is."""
    graph, length = plan.graph, _length(plan, costs)
    placed = {s.action: (s.rank, s.start) for s in replay(plan, costs)}
    movable = {a for a in placed if graph.program[a.program].spread or graph.program[a.program].runs_ahead}
    spread = [a for a in graph.actions() if a.kind == "F" and graph.program[a.program].spread]
    for _ in range(passes):
        improved = False
        for forward in spread:
            together = [a for a in (Action(k, *forward.node, forward.micro) for k in "FBW") if a in placed]
            for rank in graph.ranks_of(forward.node):
                if rank == placed[forward][0]:
                    continue
                trial = dict(placed)
                for action in together:
                    trial[action] = (rank, placed[action][1])
                try:
                    moved = _in_order(graph, costs, trial, movable)
                except GraphError:
                    continue
                if (moved_length := _length(moved, costs)) < length - 1e-12:
                    plan, placed, length, improved = moved, trial, moved_length, True
                    break
        if not improved:
            break
    return plan


# How far a backfilled action may run past the gap it is put in, as a share of its own length: measured
# gaps come a little shorter or longer than the work that would fill them, and a strict fit sends the work
# to the end of the step; each share is tried and the shortest replay kept.
OVERLAPS = (0.0, 0.1, 0.25, 0.5)
# Of actions that can start at once, which first: a backward frees what waits on it; a split backward's weight
# gradient frees nothing, so it takes what is left.
PRIORITY = {"B": 0, "F": 1, "W": 2}


def _plan(graph: Graph, costs: Costs, level: dict[Action, float], fill: frozenset[str], overlap: float,
          distinct: bool = False) -> Plan:
    """List-schedule the step's own programs but those in `fill`, then backfill `fill`'s and those running
    ahead; each rank's actions in the order of their starts."""
    fill = fill | {p.name for p in graph.programs if p.runs_ahead}
    later = [a for a in graph.actions() if a.program in fill]
    backfilled = set(later)
    first = [a for a in graph.actions() if a not in backfilled]
    placed = _list_schedule(graph, costs, first, level, fill, distinct)
    _backfill(graph, costs, later, placed, overlap, distinct)
    return _in_order(graph, costs, placed, backfilled)


def _in_order(graph: Graph, costs: Costs, placed: dict[Action, tuple[int, float]], movable: set[Action]) -> Plan:
    """Each rank's actions in the order of their planned starts, but a backfilled (`movable`) action runs
    as soon as its inputs are in: its inputs may come later than planned, and a rank whose next action
    waits on it must not wait behind it. The others keep the list schedule's order (its 1F1B bound)."""
    ends: dict[Action, float] = {}
    where = {a: rank for a, (rank, _) in placed.items()}
    waits = {a: graph.dependencies(a) for a in placed}
    free = Counter()
    by_rank: dict[int, list[Action]] = {r: [] for r in range(graph.world)}
    todo = {r: [] for r in by_rank}  # each rank's actions left, in the order of their planned starts
    for action in sorted(placed, key=lambda a: placed[a][1]):
        todo[where[action]].append(action)
    while any(todo.values()):
        best = None
        for rank, mine in todo.items():
            fixed = next((a for a in mine if a not in movable), None)
            action = next((a for a in mine if (a in movable or a is fixed)
                           and all(d in ends for d in waits[a])), None)  # the earliest planned
            if action is not None:
                start = max(free[rank], ready_at(graph, costs, action, rank, ends, where, waits[action]))
                if best is None or (start, placed[action][1]) < best[0]:
                    best = ((start, placed[action][1]), action, rank, start)
        if best is None:
            left = sorted(str(a) for mine in todo.values() for a in mine)
            raise GraphError(f"no action of {left} has its inputs: the graph has a cycle")
        _, action, rank, start = best
        todo[rank].remove(action)
        by_rank[rank].append(action)
        ends[action] = free[rank] = start + costs.seconds(action)
    return Plan(graph, {r: tuple(acts) for r, acts in by_rank.items()})


def _candidates(graph: Graph, action: Action, where: dict[Action, int], distinct: bool = False) -> tuple[int, ...]:
    """The ranks `action` may run on: a backward runs where its forward ran (its activations are there);
    with `distinct`, a part of a micro-batch where no other part of it runs, while such a rank is left."""
    if action.kind != "F":
        return (where[Action("F", *action.node, action.micro)],)
    ranks = graph.ranks_of(action.node)
    parts = graph.program[action.program].parts
    if distinct and parts > 1:
        first = action.micro - action.micro % parts
        taken = {where.get(Action("F", *action.node, m)) for m in range(first, first + parts)}
        return tuple(r for r in ranks if r not in taken) or ranks
    return ranks


def _list_schedule(graph: Graph, costs: Costs, actions: list[Action], level: dict[Action, float],
                   later: frozenset[str], distinct: bool = False) -> dict:
    """{action: (rank, start)} for `actions` by list scheduling (see the module), as if the programs in
    `later` (placed afterwards into the gaps) took no time."""
    placed: dict[Action, tuple[int, float]] = {}
    ends: dict[Action, float] = {}
    where: dict[Action, int] = {}
    free = Counter()
    held = Counter()  # micro-batches between forward and backward, per stage
    limit = {node: graph.in_flight_limit(node) for node in graph.nodes()}
    todo = set(actions)
    while todo:
        best = None
        for action in todo:
            if any(d not in ends for d in _waits(graph, action, later)):
                continue
            node = action.node
            if action.kind == "F" and graph.trains(node) and held[node] >= limit[node]:
                continue
            for rank in _candidates(graph, action, where, distinct):
                start = max(free[rank], ready_at(graph, costs, action, rank, ends, where, _waits(graph, action, later)))
                key = (start, PRIORITY[action.kind], action.micro, -level[action], str(action), rank)
                if best is None or key < best[0]:
                    best = (key, action, rank, start)
        if best is None:
            raise GraphError(f"no action of {sorted(map(str, todo))} can run: a stage's in-flight limit blocks them")
        _, action, rank, start = best
        todo.remove(action)
        placed[action], where[action] = (rank, start), rank
        ends[action] = free[rank] = start + costs.seconds(action)
        if action.kind == "F" and graph.trains(action.node):
            held[action.node] += 1
        elif action.kind == ("W" if graph.splits(action.node) else "B"):
            held[action.node] -= 1
    return placed



def _waits(graph: Graph, action: Action, later: frozenset[str]) -> list[Action]:
    return [d for d in graph.dependencies(action) if d.program not in later]


def _backfill(graph: Graph, costs: Costs, actions: list[Action], placed: dict, overlap: float = 0.0,
              distinct: bool = False) -> None:
    """Put each of `actions` (in dependency order) into the earliest gap of a rank it may run on that fits it
    (but for `overlap` of its length)."""
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in range(graph.world)}
    for action, (rank, start) in placed.items():
        busy[rank].append((start, start + costs.seconds(action)))
    ends = {a: start + costs.seconds(a) for a, (_, start) in placed.items()}
    where = {a: rank for a, (rank, _) in placed.items()}
    for action in actions:
        length = costs.seconds(action)
        rank, start = min(((r, _first_gap(sorted(busy[r]), ready_at(graph, costs, action, r, ends, where),
                                          length * (1 - overlap)))
                           for r in _candidates(graph, action, where, distinct)), key=lambda found: (found[1], found[0]))
        placed[action], where[action] = (rank, start), rank
        ends[action] = start + length
        busy[rank].append((start, start + length))


def _first_gap(intervals: list[tuple[float, float]], earliest: float, length: float) -> float:
    """The earliest time >= `earliest` where `length` seconds fit between the sorted busy `intervals`.

    >>> _first_gap([(0, 2), (3, 5), (6, 9)], 1.0, 1.0), _first_gap([(0, 2), (3, 5)], 0.0, 1.5)
    (2, 5)
    """
    t = earliest
    for begin, end in intervals:
        if t + length <= begin:
            return t
        t = max(t, end)
    return t


def _longest_path(graph: Graph, costs: Costs) -> dict[Action, float]:
    """Each action's cost plus the longest chain of actions (and transfers) that waits on it."""
    after: dict[Action, list[Action]] = {a: [] for a in graph.actions()}
    for action in after:
        for dep in graph.dependencies(action):
            after[dep].append(action)
    level: dict[Action, float] = {}
    for action in reversed(graph.actions()):
        tail = [level[n] + costs.moving(action.node, n.node) for n in after[action]]
        level[action] = costs.seconds(action) + max(tail, default=0.0)
    return level

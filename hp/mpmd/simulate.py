"""`hp.mpmd.simulate`: replay the exact actions a plan runs against a cost table, and project it to more devices.

The runtime (`hp.mpmd.runtime`) runs each rank's list of actions in order,
each as soon as its inputs have arrived. Replaying those lists with each
action's measured seconds and each transfer's (`hp.mpmd.plan.replay`)
gives the step's time, each rank's idle share, and a timeline to draw, for
a plan that was measured here or one that was not (another placement,
more micro-batches).

`project` scales a replayed step to data parallel replicas of it: 64-1024
devices are `devices / world` replicas of the plan's ranks, and the step
ends with the ring all-reduce of each rank's gradients (`2 (d - 1) / d`
times their bytes, over the bandwidth), which delays the next step's
start on every rank.

>>> from hp.mpmd.graph import Graph, Program
>>> from hp.mpmd.schedule import schedule
>>> graph = Graph((Program("lm", (0, 1)),), (), 4)
>>> costs = Costs.unit(graph)
>>> sim = simulate(schedule(graph, costs), costs)
>>> sim.step_seconds, [round(i, 3) for i in sim.idle_share]
(10.0, [0.2, 0.2])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hp.mpmd.costs import Costs
from hp.mpmd.graph import GraphError
from hp.mpmd.plan import Plan, Slot, replay
from hp.plot import require_pyplot


@dataclass(frozen=True)
class Simulation:
    """A step replayed: every action's slot, the step's length, and each rank's busy seconds."""

    slots: tuple[Slot, ...]
    world: int

    @property
    def step_seconds(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    @property
    def busy(self) -> list[float]:
        return [sum(s.end - s.start for s in self.slots if s.rank == r) for r in range(self.world)]

    @property
    def idle_share(self) -> list[float]:
        step = self.step_seconds
        return [1 - b / step if step else 0.0 for b in self.busy]

    @property
    def mean_idle_share(self) -> float:
        return sum(self.idle_share) / self.world

    def draw(self, path: str, title: str = "") -> None:
        """Each rank's actions on one time axis (a PNG): one color per program, backward darker (weight gradients darkest)."""
        draw_arms({title or f"step {self.step_seconds:.3f} s": self}, path)


def draw_arms(arms: Mapping[str, Simulation], path: str) -> None:
    """Several steps' timelines (`title: simulation`) one above the other on a shared time axis, as a PNG."""
    plt = require_pyplot("drawing an hp.mpmd plan")
    programs = sorted({s.action.program for sim in arms.values() for s in sim.slots})
    colors = dict(zip(programs, plt.get_cmap("tab10").colors))
    rows = [0.6 + 0.35 * sim.world for sim in arms.values()]
    fig, axes = plt.subplots(len(arms), 1, figsize=(10, sum(rows)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    for ax, (title, sim) in zip(axes[:, 0], arms.items()):
        for s in sim.slots:
            shade = {"F": 1.0, "B": 0.55, "W": 0.3}[s.action.kind]
            ax.barh(s.rank, s.end - s.start, left=s.start, color=tuple(c * shade for c in colors[s.action.program]),
                    edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(sim.world), [f"rank {r}" for r in range(sim.world)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title}: step {sim.step_seconds:.3f} s, mean idle {sim.mean_idle_share:.0%}", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (backward darker, a split backward's weight gradients darkest)")
    axes[0, 0].legend([plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in programs], programs, fontsize=7,
                      loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def simulate(plan: Plan, costs: Costs) -> Simulation:
    """Replay `plan` under `costs` (each rank runs its actions in order, each once its inputs arrived)."""
    return Simulation(tuple(replay(plan, costs)), plan.graph.world)


@dataclass(frozen=True)
class Projection:
    """A replayed step at `devices` devices: its time and each rank's idle share."""

    devices: int
    step_seconds: float
    idle_share: tuple[float, ...]

    @property
    def mean_idle_share(self) -> float:
        return sum(self.idle_share) / len(self.idle_share)


def project(sim: Simulation, plan: Plan, costs: Costs, devices: int, bandwidth: float) -> Projection:
    """`sim` as one of `devices / world` data parallel replicas whose gradients are all-reduced over
    `bandwidth` bytes per second at the end of the step (see the module).

    >>> from hp.mpmd.graph import Graph, Program
    >>> from hp.mpmd.schedule import schedule
    >>> graph = Graph((Program("lm", (0, 1)),), (), 4)
    >>> costs = Costs(Costs.unit(graph).compute, param_bytes={("lm", 0): 8e9, ("lm", 1): 8e9})
    >>> plan = schedule(graph, costs)
    >>> project(simulate(plan, costs), plan, costs, 64, 16e9).step_seconds  # 32 replicas: 10 s + 0.97 s
    10.96875
    """
    replicas = devices // plan.graph.world
    if replicas < 1:
        raise GraphError(f"devices = {devices}: fewer than the plan's {plan.graph.world} ranks")
    held = [sum(costs.param_bytes.get(node, 0.0) for node in plan.graph.nodes() if r in plan.graph.ranks_of(node))
            for r in range(plan.graph.world)]
    reduce_s = [2 * (replicas - 1) / replicas * b / bandwidth for b in held]
    step = sim.step_seconds + max(reduce_s)
    return Projection(devices, step, tuple(1 - busy / step for busy in sim.busy))

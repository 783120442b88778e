"""One `hp.mpmd` step on each rank's clock: when its collectives flew, and when the rank waited on them.

A profiler's timeline answers "was the communication hidden?" by showing it
beside the computation. hp's kernels stamp each collective they issue and
each wait (`hp.ops.overlap`): a collective is in flight from its issue to
its landing; the rank computed while it flew until it waited, and was
blocked (the exposed part) from then until it landed. The landing is the
backend's own report where it gives one (gloo's work futures, so a
collective that landed long before its wait is not counted in flight past
its landing), else the end of the wait. Whatever the step did
outside those waits is computation (or hp's host work), as the profiler
counts it. `draw` puts every rank's step on one PNG (the `plot` extra).

>>> from hp.ops.overlap import Span
>>> line = Timeline(rank=0, seconds=1.0, spans=(Span("all_gather", 0.25, 0.5, 0.75),))
>>> line.flight_seconds, line.exposed_seconds, line.overlapped_seconds, line.masking
(0.5, 0.25, 0.25, 0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from hp.ops.overlap import Span
from hp.plot import require_pyplot

_COLORS = {"compute": "#b0b0b0", "flight": "#4c72b0", "exposed": "#c44e52"}


@dataclass(frozen=True)
class Timeline:
    """One rank's step: its length and its collectives' spans, in seconds from the step's start.

    `started` is the step's start on the rank's clock (`time.perf_counter`), which the processes
    of one host share: it lines their timelines up (`waiting_for_peers`).
    """

    rank: int
    seconds: float
    spans: tuple[Span, ...]
    started: float = 0.0

    @property
    def flight_seconds(self) -> float:
        """How long some collective was in flight (overlapping flights counted once)."""
        return _union((s.issued, s.landed) for s in self.spans)

    @property
    def exposed_seconds(self) -> float:
        """How long the rank was blocked on a collective."""
        return _union(filter(None, (s.blocked for s in self.spans)))

    @property
    def overlapped_seconds(self) -> float:
        """How long collectives flew while the rank computed."""
        return self.flight_seconds - self.exposed_seconds

    @property
    def masking(self) -> float:
        """The share of the in-flight time the rank computed through (1.0 with nothing in flight)."""
        return self.overlapped_seconds / self.flight_seconds if self.flight_seconds > 0 else 1.0


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def waiting_for_peers(timelines: Sequence[Timeline]) -> list[float]:
    """Of each rank's exposed time, the seconds it waited for another rank to issue the same collective.

    The part of a wait before the last rank issued the collective is synchronization (what
    Ascend's profiler calls wait time): no overlap on this rank could have shortened it, only
    its peers arriving sooner. The rest is transfer. The timelines must come from processes of
    one host (a shared clock) that issued the same collectives in the same order.

    >>> from hp.ops.overlap import Span
    >>> early = Timeline(0, 1.0, (Span("all_gather", 0.1, 0.2, 0.6),), started=10.0)
    >>> late = Timeline(1, 1.0, (Span("all_gather", 0.4, 0.4, 0.6),), started=10.0)
    >>> [round(w, 3) for w in waiting_for_peers([early, late])]
    [0.2, 0.0]
    """
    kinds = {tuple(s.kind for s in line.spans) for line in timelines}
    if len(kinds) > 1:
        raise ValueError("the ranks' timelines hold different collectives: they are not one group's steps")
    all_issued = [max(t.started + t.spans[i].issued for t in timelines) for i in range(len(timelines[0].spans))]
    return [sum(max(0.0, min(line.started + s.landed, issued) - (line.started + s.waited))
                for s, issued in zip(line.spans, all_issued)) for line in timelines]


def gathered(timeline: Timeline) -> list[Timeline]:
    """Every rank's timeline, in rank order (a collective: every rank calls it); this one alone without ranks."""
    if not dist.is_available() or not dist.is_initialized():
        return [timeline]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, timeline)
    return out


def draw(timelines: Sequence[Timeline], path: str) -> None:
    """A PNG of the steps, one row per rank: computation grey, collectives in flight blue, exposed red.

    Needs matplotlib (`pip install 'hp[plot]'`).
    """
    plt = require_pyplot("drawing an hp.mpmd timeline")
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.8 * len(timelines)))
    for row, line in enumerate(timelines):
        y = len(timelines) - 1 - row
        ax.broken_barh([(0, line.seconds * 1e3)], (y - 0.35, 0.7), color=_COLORS["compute"])
        flights = [(s.issued * 1e3, (s.landed - s.issued) * 1e3) for s in line.spans]
        ax.broken_barh(flights, (y - 0.1, 0.45), color=_COLORS["flight"])
        blocked = [(a * 1e3, (b - a) * 1e3) for a, b in filter(None, (s.blocked for s in line.spans))]
        ax.broken_barh(blocked, (y - 0.35, 0.25), color=_COLORS["exposed"])
        ax.text(line.seconds * 1e3, y, f"  masked {line.masking:.0%}",
                va="center", fontsize=8)
    ax.set_yticks(range(len(timelines)), [f"rank {line.rank}" for line in reversed(timelines)])
    ax.set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["computing", "collective in flight", "blocked on it (exposed)"], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(timelines) < 3 else -0.15), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""How many chunks hp's kernels pipeline their collectives over, and how long a step waited on them.

`hp.mpmd` sets the chunk count for the duration of a step; a kernel that can
split its work into independent chunks (the expert-parallel all-to-alls of
`hp.ops.expert_parallel`) reads it with `chunks()`, issues each chunk's
collective asynchronously and computes another chunk while it flies. Every
wait such a kernel does is timed here (`waited`): the communication the
step could not hide, per kind of collective. Outside `hp.mpmd` the count is
1 and kernels run as they always did.

>>> with pipelined(2) as waits:
...     chunks()
2
>>> chunks()
1
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol


@dataclass
class Waits:
    """Seconds a step spent blocked on pipelined collectives, and how many it waited on, by kind."""

    seconds: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.count[kind] = self.count.get(kind, 0) + 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


_STATE: contextvars.ContextVar[tuple[int, Waits] | None] = contextvars.ContextVar("hp_overlap", default=None)


def chunks() -> int:
    """The chunk count kernels pipeline over now (1: not pipelined)."""
    state = _STATE.get()
    return 1 if state is None else state[0]


@contextmanager
def pipelined(count: int) -> Iterator[Waits]:
    """Kernels inside pipeline their collectives over `count` chunks; yields the waits they record."""
    waits = Waits()
    token = _STATE.set((count, waits))
    try:
        yield waits
    finally:
        _STATE.reset(token)


def wait(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """`tensor` (a collective's pending result) once it has landed, the time blocked on it recorded."""
    state = _STATE.get()
    if state is None:
        return funcol.wait_tensor(tensor)
    start = time.perf_counter()
    landed = funcol.wait_tensor(tensor)
    state[1].add(kind, time.perf_counter() - start)
    return landed

"""How many chunks hp's kernels pipeline their collectives over, and when a step waited on them.

`hp.mpmd` sets the chunk count for the duration of a step; a kernel that can
split its work into independent chunks (the expert-parallel all-to-alls of
`hp.ops.expert_parallel`, the tensor-parallel linears of
`hp.ops.pipelined_linear`) reads it with `chunks()`, issues each chunk's
collective asynchronously and computes another chunk while it flies. Every
collective hp's kernels issue is stamped (`issued`) and every wait on one is
timed (`wait`): the communication the step could not hide, per kind of
collective, and each collective's `Span` for the step's timeline. A module
whose output resolves a pending sum tells its row-parallel kernel the layout
(`reduce_into`), so that the kernel can reduce chunk by chunk. Outside
`hp.mpmd` the count is 1 and kernels run as they always did.

>>> with pipelined(2) as waits:
...     chunks()
2
>>> chunks()
1
"""

from __future__ import annotations

import contextvars
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class Span:
    """One collective on this rank's clock (`time.perf_counter`): issued, waited for, landed.

    From `issued` to `landed` it was in flight; from `waited` to `landed` the rank was blocked on it
    (exposed), and before `waited` it flew behind whatever the rank computed (overlapped). A
    collective issued and waited at once has `issued == waited`: all of it exposed. One that landed
    before the rank waited for it (`landed <= waited`) was not waited on at all. `landed` is the
    moment the backend reported the collective complete where it reports one (gloo's work
    futures), else the moment the wait returned.
    """

    kind: str
    issued: float
    waited: float
    landed: float

    @property
    def blocked(self) -> tuple[float, float] | None:
        """(from, to) while the rank was blocked on it; None when it had landed before the wait."""
        return (self.waited, self.landed) if self.landed > self.waited else None


@dataclass
class Waits:
    """The collectives a step waited on: each one's span, and how many of each kind."""

    spans: list[Span] = field(default_factory=list)

    @property
    def count(self) -> dict[str, int]:
        return dict(Counter(s.kind for s in self.spans))


_STATE: contextvars.ContextVar[tuple[int, Waits] | None] = contextvars.ContextVar("hp_overlap", default=None)


def chunks() -> int:
    """The chunk count kernels pipeline over now (1: not pipelined)."""
    state = _STATE.get()
    return 1 if state is None else state[0]


def active() -> bool:
    """Whether a step runs inside `hp.mpmd` (its waits timed, even over one chunk)."""
    return _STATE.get() is not None


_REDUCTION: contextvars.ContextVar[tuple[torch.Tensor, tuple] | None] = contextvars.ContextVar(
    "hp_reduction", default=None)


def reduce_into(weight: torch.Tensor, placements: tuple) -> None:
    """The next row-parallel product by `weight` may resolve its pending sum into `placements` itself.

    The module whose output joins the residual stream knows the layout its pending sum resolves
    into; its linear kernel does not. Told, the kernel can reduce chunk by chunk while it
    multiplies (`hp.ops.pipelined_linear`). The kernel takes the message (`reduction`); one left
    untaken (a forward that failed) names a weight that only its own module's next call tells anew.
    """
    _REDUCTION.set((weight, placements))


def reduction(weight: torch.Tensor) -> tuple | None:
    """The placements the product by `weight` resolves into, when its module said so (`reduce_into`); taken once."""
    told = _REDUCTION.get()
    if told is None or told[0] is not weight:
        return None
    _REDUCTION.set(None)
    return told[1]


@contextmanager
def pipelined(count: int) -> Iterator[Waits]:
    """Kernels inside pipeline their collectives over `count` chunks; yields the waits they record."""
    waits = Waits()
    token = _STATE.set((count, waits))
    try:
        yield waits
    finally:
        _STATE.reset(token)


class InFlight:
    """A collective issued through c10d's asynchronous work: `finish(output)` once `work` has completed.

    hp's kernels issue on gloo groups this way (`hp.ops.collectives`); `wait` lands it as it
    lands a functional collective's pending result. `finish` is the local step that turns what
    arrived into the result (summing the blocks an all-to-all brought in), done after the wait.
    """

    __slots__ = ("output", "work", "finish", "issued", "landed")

    def __init__(self, output: torch.Tensor, work, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.output, self.work, self.finish = output, work, finish
        self.issued: float | None = None
        self.landed: float | None = None  # set by the backend's thread, where its work has a future

    def stamp(self, issued: float) -> None:
        """Time this collective: issued at `issued`, landed when the backend completes its future."""
        self.issued = issued
        try:
            future = self.work.get_future()
        except RuntimeError:  # a work without a future lands when it is waited for
            return
        future.add_done_callback(self._land)

    def _land(self, _future) -> None:
        self.landed = time.perf_counter()

    def arrive(self) -> None:
        self.work.wait()

    def result(self) -> torch.Tensor:
        return self.output if self.finish is None else self.finish(self.output)


def issued(issue: Callable[[], Any]):
    """The pending result `issue()` returns (a collective's), stamped inside `hp.mpmd` with the time
    it was issued: before the call, so that whatever the backend does at issue counts as communication."""
    if torch.compiler.is_compiling() or not active():  # a traced graph reads no context variables
        return issue()
    stamp = time.perf_counter()
    pending = issue()
    if isinstance(pending, InFlight):
        pending.stamp(stamp)
    elif isinstance(pending, funcol.AsyncCollectiveTensor):
        pending._hp_issued = stamp
    return pending


def wait(pending, kind: str) -> torch.Tensor:
    """`pending` (a collective's pending result) once it has landed, the time blocked on it recorded."""
    if isinstance(pending, InFlight):
        _timed(pending.arrive, kind, pending.issued, lambda: pending.landed)
        return pending.result()
    if torch.compiler.is_compiling() or not isinstance(pending, funcol.AsyncCollectiveTensor):
        return funcol.wait_tensor(pending)  # a traced graph orders its own waits; a plain tensor has landed
    return _timed(lambda: funcol.wait_tensor(pending), kind, getattr(pending, "_hp_issued", None))


def _timed(arrive: Callable[[], Any], kind: str, issued: float | None, reported=lambda: None):
    """`arrive()`, recorded as a span inside `hp.mpmd`: landed when the backend `reported` it, else now."""
    state = _STATE.get()
    if state is None:
        return arrive()
    start = time.perf_counter()
    arrived = arrive()
    end = time.perf_counter()
    landed = reported()  # the backend's callback may not have run yet when the wait returns
    state[1].spans.append(Span(kind, start if issued is None else issued, start,
                               end if landed is None else min(landed, end)))
    return arrived

"""`hp.mpmd(step)`: a training step whose collectives fly while other work computes (communication masking).

Level 1 of MPMD runs independent pieces of one rank's step concurrently:
hp's kernels that can cut their work into independent chunks pipeline it
(`hp.ops.overlap`):

* the expert-parallel all-to-alls send every token chunk at once, and each
  chunk's experts compute while later chunks' rows arrive and earlier
  chunks' results travel back (`hp.ops.expert_parallel`);
* Megatron's tensor-parallel linears gather a sequence-parallel input chunk
  by chunk, each chunk multiplied as it lands, and reduce-scatter (or
  all-reduce) a row-parallel output chunk by chunk as it is computed; in
  backward the input gradient's reduction flies while the next chunk's and
  the weight's gradients compute (`hp.ops.pipelined_linear`).

The step itself is unchanged: same arguments, same results, the same bytes
moved (in more, smaller collectives).

The chunk count is planned from measurements of the step itself. The first
call runs it as it is, to warm up (allocations, the ranks' start-up skew);
the second runs it as it is too (one chunk), and the time its collectives
were in flight, from issue to landing, is the step's whole communication
time. The third call runs it pipelined over 2 chunks; under "auto", while
a count makes the step faster than every count before it, the next call
tries the next count (4, then 8), and the fastest is kept. If 2 chunks
were already slower than the step as it is (chunks too small to pay for
themselves), later calls run unpipelined and `plan.reason` says why. Every
rank takes the slowest rank's times, so all choose alike (their
collectives must match). Each call's `report` holds its step time,
its communication time, the part left exposed (time blocked on hp's
collectives) and the masking ratio, 1 - exposed / communication: the share
of the communication hidden behind computation, as Ascend's profiler
reports it; its `timeline` has every collective's issue, wait and landing
on this rank's clock, and `draw(path)` puts every rank's on one PNG
(`hp.mpmd.timeline`).

What hp's kernels do not issue is neither pipelined nor timed: FSDP's
gathers and reduce-scatters (FSDP2 prefetches its next unit's gathers
itself), DTensor's own redistributions, and `hp.reduce_gradients`. The
step's waits are timed on the thread that runs it: where autograd runs
backward on threads of its own (CUDA, NPU), backward's waits are not
counted.

>>> import torch
>>> step = mpmd(lambda x: (x * 2).sum(), chunks=2)
>>> [float(step(torch.ones(3))) for _ in range(3)], step.plan.chunks
([6.0, 6.0, 6.0], 2)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp.mpmd.placed import Placed, placed
from hp.mpmd.timeline import Timeline, draw, gathered
from hp.ops import overlap
from hp.ops.overlap import Span
from hp.parallel.model_plan import ModelPlan
from hp.parallel.strategy import Strategy, is_chunks


class MpmdError(ValueError):
    """An `hp.mpmd` setting that cannot work."""


AUTO_CHUNKS = (2, 4, 8)  # the counts "auto" tries in turn, while each makes the step faster


@dataclass(frozen=True)
class Plan:
    """How the step runs: over `chunks` chunks (1: as it is), and why when the planner kept it as it is.

    `tried` holds each count the planner ran, with the slowest rank's step seconds (1: as it is).
    """

    chunks: int
    reason: str = ""
    tried: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepReport:
    """One call's times, in seconds on this rank, and the share of its communication hidden behind computation."""

    chunks: int
    comm_seconds: float  # the step's communication time as it is: its collectives in flight (the second call's)
    timeline: Timeline  # this call on this rank's clock: its length and its collectives

    @property
    def step_seconds(self) -> float:
        return self.timeline.seconds

    @property
    def exposed_seconds(self) -> float:
        """Time blocked on the step's collectives in this call."""
        return self.timeline.exposed_seconds

    @property
    def masking(self) -> float:
        """1 - exposed / communication (1.0 when the step communicated nothing)."""
        if self.comm_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_seconds / self.comm_seconds)


class Mpmd:
    """`step` with its collectives pipelined over the planned chunks; `plan` and `report` say how it went."""

    def __init__(self, step: Callable, chunks: int | str) -> None:
        if not is_chunks(chunks):
            raise MpmdError(f"chunks = {chunks!r}: expected an integer >= 1, or 'auto'")
        self._step = step
        self._asked = chunks
        self.plan: Plan | None = None
        self.report: StepReport | None = None
        self._calls = 0
        self._comm_seconds = 0.0
        self._tried: list[tuple[int, float]] = []  # (chunks, the slowest rank's step seconds)
        functools.update_wrapper(self, step, updated=())  # its name and doc; not its attributes (a wrapped step object keeps its own)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls <= 2:  # warm-up, then as it is: its time in flight is the whole communication
            result, timeline = self._timed(1, args, kwargs)
            if self._calls == 2:
                self._tried.append((1, _slowest(timeline.seconds)[0]))  # the plan compares the slowest rank's times
                self._comm_seconds = timeline.flight_seconds
            self.report = StepReport(1, timeline.flight_seconds, timeline)
            return result
        trying = self.plan is None
        chunks = self._candidate() if trying else self.plan.chunks
        result, timeline = self._timed(chunks, args, kwargs)
        self.report = StepReport(chunks, self._comm_seconds, timeline)
        if trying:
            self._tried.append((chunks, _slowest(timeline.seconds)[0]))
            self.plan = self._decide()
        return result

    def _candidate(self) -> int:
        """The count to run next while planning: the one asked, or under 'auto' the next after the last tried."""
        if self._asked != "auto":
            return self._asked
        return next(c for c in AUTO_CHUNKS if c > self._tried[-1][0])

    def _decide(self) -> Plan | None:
        """The plan once the trials are over (None: try the next count).

        A count asked for is kept. Under 'auto' the next count is tried while the last one made the
        step faster than every count before it; then the fastest is kept.
        """
        tried = tuple(self._tried)
        if self._asked != "auto":
            return Plan(tried[-1][0], tried=tried)
        fastest = min(tried, key=lambda t: t[1])
        if fastest == tried[-1] and fastest[0] < AUTO_CHUNKS[-1]:
            return None
        if fastest[0] > 1:
            return Plan(fastest[0], tried=tried)
        (_, plain), (chunks, seconds) = tried[0], tried[1]
        return Plan(1, f"pipelined over {chunks} chunks the step took {seconds:.4g} s against {plain:.4g} s as "
                       "it is: its collectives are too small to pay for chunking", tried)

    def draw(self, path: str) -> None:
        """The last call's timeline of every rank as a PNG (`hp.mpmd.timeline.draw`; the `plot` extra).

        A collective: every rank calls it; rank 0 writes the file.
        """
        if self.report is None:
            raise MpmdError("no step has run yet: call the step before drawing its timeline")
        timelines = gathered(self.report.timeline)
        if not dist.is_initialized() or dist.get_rank() == 0:
            draw(timelines, path)

    def _timed(self, chunks: int, args: tuple, kwargs: dict) -> tuple[Any, Timeline]:
        start = time.perf_counter()
        with overlap.pipelined(chunks) as waits:
            result = self._step(*args, **kwargs)
        seconds = time.perf_counter() - start
        spans = tuple(Span(s.kind, s.issued - start, s.waited - start, s.landed - start) for s in waits.spans)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return result, Timeline(rank, seconds, spans, started=start)


def _slowest(*seconds: float) -> tuple[float, ...]:
    """`seconds` maxed over every rank (as they are alone)."""
    if not dist.is_available() or not dist.is_initialized():
        return seconds
    device = {"nccl": "cuda", "hccl": "npu"}.get(dist.get_backend(), "cpu")
    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(values.tolist())


def mpmd(step: Callable | nn.Module, *, chunks: int | str | None = None, place: Mapping[str, str] | None = None,
         mesh: Mapping[str, Sequence[int]] | None = None, plan: ModelPlan | None = None,
         microbatches: int | None = None, warmup: int = 3, strategy: Strategy | None = None,
         zero_bubble: bool = False) -> Mpmd | Placed:
    """Level 1: `step` (any function running forward and backward) with hp's collectives pipelined over
    `chunks`; levels 2 and 3, given `place`: the model `step`'s sub-models on the named sub-meshes of `mesh`.

    `chunks` is a count, or "auto" (the default): the planner tries 2, 4 and 8 in turn while each makes
    the step faster, and keeps the fastest (1 when 2 already made it slower). The step's results are
    the same; see the module docstring for what runs concurrently.

    With `place` (`hp.mpmd.placed`): `step` is the model, `plan` its family's `hp.ModelPlan`,
    `microbatches` the samples of a step's batch; the result is called with a batch, runs its forward
    and backward over the ranks, and returns its loss, its order of work planned from the costs its
    first `warmup` steps measured; `strategy` (tp, sp): each stage laid out over tp ranks, the world that
    many planes of `mesh`'s ranks; `zero_bubble`: the language model's stages split their backward into
    their inputs' gradients and their weights' (`hp.mpmd.backward`), the latter planned into the gaps.

    >>> import torch
    >>> step = mpmd(lambda: torch.ones(2).sum(), chunks="auto")
    >>> float(step()), step.report.masking  # a step without collectives hides all it has
    (2.0, 1.0)
    """
    if place is None:
        if zero_bubble:
            raise MpmdError("zero_bubble without place: only a placed step (levels 2 and 3) has a pipeline whose "
                            "backward splits")
        return Mpmd(step, "auto" if chunks is None else chunks)
    if chunks is not None:
        raise MpmdError(f"chunks = {chunks!r} with place: chunks pipeline one rank's collectives (level 1); a placed "
                        "step's stages run no collectives of their own")
    if not isinstance(step, nn.Module):
        raise MpmdError(f"place: the step to place is the model itself (an nn.Module), not {type(step).__name__}")
    return placed(step, place, mesh or {}, plan=plan, microbatches=microbatches, warmup=warmup, strategy=strategy,
                  zero_bubble=zero_bubble)

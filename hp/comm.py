"""`hp.comm.trace()`: count every collective, its bytes, mesh axis and source line.

Communication is part of correctness here, so it must be measurable: tests
assert the exact number and bytes of collectives a layout implies. A trace is
an observer of `hp.watch`: it keeps every collective the hub reports, those
DTensor issues inside its ops and those issued outside any op. It works on
real gloo/nccl/hccl groups, on the `fake` backend and under
`hp.simulated(mesh)` (LocalTensorMode), nested in any order with other
traces, `hp.explain` and `hp.strict`.

Bytes are those one rank sends under ring algorithms (`hp.cost.ring_bytes`,
whose docstring gives the formulas); each rank receives as many as it sends.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict

import torch

from hp.watch import Collective, Observer, OpEvent

__all__ = ["Collective", "Trace", "trace", "trace_each"]


class Trace(Observer):
    """The collectives seen while it was active; enter with `hp.comm.trace()`."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def on_op(self, event: OpEvent) -> None:
        self.records.extend(event.collectives)

    def on_collective(self, event: OpEvent) -> None:
        self.records.extend(event.collectives)

    # -- queries ------------------------------------------------------------

    def select(self, kind: str | None = None, axis: str | None = None, phase: str | None = None) -> list[Collective]:
        """The records of that kind, axis and phase (None: any)."""
        return [
            r
            for r in self.records
            if (kind is None or r.kind == kind)
            and (axis is None or r.axis == axis)
            and (phase is None or r.phase == phase)
        ]

    def count(self, kind: str | None = None, axis: str | None = None, phase: str | None = None) -> int:
        return len(self.select(kind, axis, phase))

    def bytes(self, kind: str | None = None, axis: str | None = None, phase: str | None = None) -> int:
        """Bytes sent per rank, summed over the selected collectives."""
        return sum(r.bytes for r in self.select(kind, axis, phase))

    def per_axis(self) -> dict[str, dict[str, int]]:
        """{axis: {kind: bytes per rank}} over everything recorded."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[r.axis][r.kind] += r.bytes
        return {a: dict(k) for a, k in out.items()}

    def table(self) -> str:
        """One line per (phase, kind, axis, source): count and bytes per rank."""
        rows: dict[tuple, list[int]] = {}
        for r in self.records:
            key = (r.phase, r.kind, r.axis, r.source)
            rows.setdefault(key, [0, 0])
            rows[key][0] += 1
            rows[key][1] += r.bytes
        lines = [f"{'phase':<9}{'kind':<16}{'axis':<8}{'count':>6}{'bytes/rank':>14}  source"]
        for (phase, kind, axis, source), (n, b) in rows.items():
            lines.append(f"{phase:<9}{kind:<16}{axis:<8}{n:>6}{b:>14}  {source}")
        lines.append(f"{'total':<33}{len(self.records):>6}{self.bytes():>14}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {"collectives": [asdict(r) for r in self.records], "per_axis": self.per_axis()}
        )


@contextmanager
def trace() -> Iterator[Trace]:
    """Record the collectives issued inside the block.

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(dp=2, tp=2, simulate=True)
    >>> with LocalTensorMode(4):
    ...     x = hp.shard(torch.ones(8, 4), "b h +tp", mesh)
    ...     with hp.comm.trace() as t:
    ...         y = hp.constrain(x, "b h")
    >>> t.count("all_reduce", axis="tp"), t.bytes()
    (1, 128)
    """
    with Trace() as tracer:
        yield tracer


def trace_each(modules: Iterable[torch.nn.Module]) -> list[Trace]:
    """One trace per forward call of each module, in call order (e.g. per decoder layer).

    >>> import hp, torch
    >>> layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    >>> traces = hp.comm.trace_each(layers)
    >>> _ = layers[1](layers[0](torch.ones(1, 2)))
    >>> [t.count() for t in traces]
    [0, 0]
    """
    traces: list[Trace] = []

    def start(mod, args):
        traces.append(Trace())
        traces[-1].__enter__()

    def stop(mod, args, out):
        traces[-1].__exit__(None, None, None)

    for m in modules:
        m.register_forward_pre_hook(start)
        m.register_forward_hook(stop, always_call=True)
    return traces

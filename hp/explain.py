"""`hp.explain` and `hp.strict`: what each op did with layouts, and where it communicated.

Both are observers of `hp.watch`, which reports every op on DTensors with
the collectives DTensor inserted to run it. `explain` notes each op's input
and output layouts and those collectives; collectives outside any op (an
`hp.constrain`) are noted as explicit, and so are hp's own kernels (2D
linear, vocab-parallel loss, ...), each one row with its layouts and the
collectives it ran. `explain` returns the table; `strict` raises as soon as
an op redistributes in the forward pass without having been asked to, naming
the op, its layouts and the source line. (Backward communication mirrors the
forward choices and is not checked.) Both nest in any order with each other
and with `hp.comm.trace()`, and see the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from hp.layouts import describe
from hp.source import in_backward, user_line
from hp.watch import Collective, Observer, OpEvent


class StrictError(RuntimeError):
    """An op redistributed its inputs although no constrain or plan asked for it."""


@dataclass
class OpRecord:
    op: str
    inputs: list[str]
    outputs: list[str]
    collectives: list[Collective] = field(default_factory=list)
    implicit: bool = True  # False: explicitly requested (hp.constrain, an hp kernel)
    phase: str = "forward"
    source: str = ""


class Explanation:
    """The records of one `hp.explain` run; `str()` prints the per-op table."""

    def __init__(self, records: list[OpRecord], result=None) -> None:
        self.records = records
        self.result = result

    def communicating(self) -> list[OpRecord]:
        return [r for r in self.records if r.collectives]

    def __str__(self) -> str:
        lines = [f"{'phase':<9}{'op':<44}{'inputs -> outputs':<60}collectives  source"]
        for r in self.records:
            comm = ", ".join(f"{c.kind}[{c.axis}] {c.bytes}B" for c in r.collectives) or "-"
            if r.collectives and not r.implicit:
                comm += " (explicit)"
            flow = f"{', '.join(r.inputs)} -> {', '.join(r.outputs)}"
            lines.append(f"{r.phase:<9}{r.op:<44}{flow:<60}{comm}  {r.source}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps([asdict(r) for r in self.records])


class _Recorder(Observer):
    """Keeps an `OpRecord` per op on DTensors, per kernel of hp's own and per collective outside both."""

    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self._kernels: list[OpRecord] = []  # hp kernels running now, innermost last

    def on_op(self, event: OpEvent) -> None:
        self.records.append(
            OpRecord(
                op=event.op,
                inputs=[describe(a) for a in event.inputs],
                outputs=[describe(o) for o in event.outputs],
                collectives=list(event.collectives),
                phase=event.phase,
                source=event.source,
            )
        )

    def on_collective(self, event: OpEvent) -> None:
        if self._kernels:  # a kernel of hp's own ran it
            self._kernels[-1].collectives.extend(event.collectives)
        else:  # hp.constrain or FSDP ran it: asked for
            self.records.append(OpRecord(event.op, [], [], list(event.collectives), False, event.phase, event.source))

    def begin_kernel(self, name: str, inputs: list) -> OpRecord:
        record = OpRecord(
            op=f"hp kernel {name}",
            inputs=[describe(a) for a in inputs if isinstance(a, DTensor)],
            outputs=[],
            implicit=False,
            phase="backward" if in_backward() else "forward",
            source=user_line(),
        )
        self._kernels.append(record)
        return record

    def end_kernel(self, handle: OpRecord, outputs: list) -> None:
        self._kernels.remove(handle)
        if outputs and outputs[0] is not NotImplemented:
            handle.outputs = [describe(o) for o in tree_flatten(outputs)[0] if isinstance(o, DTensor)]
            self.records.append(handle)


class _Strict(_Recorder):
    """Records like `explain`, and raises StrictError at an op that communicated in forward."""

    def on_op(self, event: OpEvent) -> None:
        super().on_op(event)
        record = self.records[-1]
        if record.collectives and record.phase == "forward":
            moved = ", ".join(f"{c.kind} over {c.axis} ({c.bytes} bytes/rank)" for c in record.collectives)
            raise StrictError(
                f"hp.strict: {record.op} at {record.source} redistributed its inputs "
                f"({moved}) but no hp.constrain or plan asked for it; inputs: "
                f"{', '.join(record.inputs)}. Add hp.constrain(...) where the layout should change."
            )


def explain(fn, *args, **kwargs) -> Explanation:
    """Run `fn(*args, **kwargs)` and record each DTensor op's layouts and collectives.

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with LocalTensorMode(2):
    ...     x = hp.shard(torch.ones(4, 8), "b h/tp", mesh)
    ...     w = hp.shard(torch.ones(8, 6), "h/tp f", mesh)
    ...     report = hp.explain(lambda: (x @ w).sum())
    >>> [(r.op, r.inputs, r.outputs) for r in report.records][0]
    ('aten.mm.default', ['f32[b=4, h=8/tp]', 'f32[h=8/tp, f=6]'], ['f32[4, 6] +tp'])
    """
    with _Recorder() as recorder:
        result = fn(*args, **kwargs)
    return Explanation(recorder.records, result)


@contextmanager
def strict() -> Iterator[_Strict]:
    """Inside, an op that redistributes in forward without being asked raises StrictError.

    It yields a recorder whose `.records` are those `hp.explain` would show.

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with LocalTensorMode(2):
    ...     x = hp.shard(torch.ones(4, 8), "b h/tp", mesh)
    ...     with hp.strict():
    ...         y = hp.constrain(x, "b h")      # asked for: fine
    ...         try:
    ...             x + hp.shard(torch.ones(4, 8), "b/tp h", mesh)   # not asked for
    ...         except hp.StrictError as e:
    ...             print(str(e).split(" at ")[0])
    hp.strict: aten.add.Tensor
    """
    with _Strict() as recorder:
        yield recorder

"""`hp.comm.trace()`: count every collective, its bytes, mesh axis and source line.

Communication is part of correctness here, so it must be measurable: tests
assert the exact number and bytes of collectives a layout implies. The
tracer is a dispatch mode that lets DTensor desugar its ops first (it returns
`NotImplemented` for DTensor ops) and then sees the collectives DTensor
issues on local tensors. It works on real gloo/nccl/hccl groups, on the
`fake` backend and under `hp.simulated(mesh)` (LocalTensorMode), in either
nesting order.

Bytes are those one rank sends under ring algorithms (`hp.cost.ring_bytes`,
whose docstring gives the formulas); each rank receives as many as it sends.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from hp.cost import ring_bytes
from hp.mesh import axis_of_group
from hp.simulate import Watching
from hp.source import in_backward, user_line


@dataclass(frozen=True)
class Collective:
    """One collective as one rank sees it."""

    kind: str
    axis: str
    group_size: int
    payload_bytes: int  # N in the module docstring
    bytes: int  # sent (= received) by one rank
    phase: str  # "forward" or "backward"
    source: str


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _group(ref) -> tuple[str, int]:
    """(mesh axis, size) of a process group given by name or object."""
    pg = _resolve_process_group(ref) if isinstance(ref, str) else ref
    if isinstance(pg, torch.ScriptObject):  # c10d ops called from C++ (FSDP2) carry the boxed group
        pg = torch.distributed.ProcessGroup.unbox(pg)
    axis = axis_of_group(pg.group_name)
    if axis is None:
        desc = getattr(pg, "group_desc", "") or ""
        axis = desc.removeprefix("mesh_") if desc.startswith("mesh_") else "world"
    return axis, pg.size()


def _one_rank(sizes) -> list[int]:
    """Split sizes as the first simulated rank sees them (per-rank SymInts under LocalTensorMode)."""
    out = []
    for n in sizes:
        node = getattr(n, "node", None)
        local = getattr(node, "_local_ints", None)
        out.append(int(local[min(local)]) if local else int(getattr(node, "val", n)))
    return out


def _all_to_all(t: torch.Tensor, input_splits, group):
    """An all-to-all; one that sends to a single peer (a ring shift) is a `send_recv` of what it sends."""
    splits = _one_rank(input_splits or [])
    if sum(1 for n in splits if n) == 1:
        rows = t.shape[0] if t.ndim else 1
        return "send_recv", _nbytes(t) * max(splits) // max(rows, 1), group
    return "all_to_all", _nbytes(t), group


def _functional(kind: str, payload: Callable, group_arg: int):
    return lambda args: (kind, payload(args), args[group_arg])


# op name -> args -> (kind, payload bytes, group); functional collectives take a group name
_FUNCTIONAL = {
    "all_reduce": _functional("all_reduce", lambda a: _nbytes(a[0]), 2),
    "all_reduce_coalesced": _functional("all_reduce", lambda a: sum(map(_nbytes, a[0])), 2),
    "all_gather_into_tensor": _functional("all_gather", lambda a: _nbytes(a[0]) * a[1], 2),
    "all_gather_into_tensor_coalesced": _functional(
        "all_gather", lambda a: sum(map(_nbytes, a[0])) * a[1], 2
    ),
    "reduce_scatter_tensor": _functional("reduce_scatter", lambda a: _nbytes(a[0]), 3),
    "reduce_scatter_tensor_coalesced": _functional(
        "reduce_scatter", lambda a: sum(map(_nbytes, a[0])), 3
    ),
    "all_to_all_single": lambda a: _all_to_all(a[0], a[2], a[3]),
    "broadcast": _functional("broadcast", lambda a: _nbytes(a[0]), 2),
    "shard_dim_alltoall": _functional("all_to_all", lambda a: _nbytes(a[0]), 3),
}
# in-place c10d ops (dist.all_reduce and friends): args carry a ProcessGroup object
_C10D = {
    "allreduce_": lambda a: ("all_reduce", sum(map(_nbytes, a[0])), a[1]),
    "allgather_": lambda a: ("all_gather", sum(map(_nbytes, a[0][0])), a[2]),
    "_allgather_base_": lambda a: ("all_gather", _nbytes(a[0]), a[2]),
    "reduce_scatter_": lambda a: ("reduce_scatter", sum(map(_nbytes, a[1][0])), a[2]),
    "_reduce_scatter_base_": lambda a: ("reduce_scatter", _nbytes(a[1]), a[2]),
    "alltoall_base_": lambda a: ("all_to_all", _nbytes(a[1]), a[2]),
    "broadcast_": lambda a: ("broadcast", sum(map(_nbytes, a[0])), a[1]),
    "scatter_": lambda a: ("scatter", sum(map(_nbytes, a[0])) * len(a[1][0]) if a[1] else 0, a[2]),
}


def _parse(func, args) -> tuple[str, int, object] | None:
    ns, name = func.namespace, func._opname
    table = {"_c10d_functional": _FUNCTIONAL, "_dtensor": _FUNCTIONAL, "c10d": _C10D}.get(ns)
    if table is None or name not in table:
        return None
    return table[name](args)


class Trace(Watching):
    """The collectives seen while it was active; enter with `hp.comm.trace()`."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar; its collectives come back here
        if isinstance(func, torch._ops.OpOverload):
            self.observe(func, args)
        return func(*args, **kwargs)

    def observe(self, func, args) -> Collective | None:
        parsed = _parse(func, args)
        if parsed is None:
            return None
        kind, payload, group = parsed
        axis, p = _group(group)
        record = Collective(
            kind=kind,
            axis=axis,
            group_size=p,
            payload_bytes=payload,
            bytes=ring_bytes(kind, payload, p),
            phase="backward" if in_backward() else "forward",
            source=user_line(),
        )
        self.records.append(record)
        return record

    # -- queries ------------------------------------------------------------

    def select(self, kind: str | None = None, axis: str | None = None, phase: str | None = None):
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
def trace():
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
    tracer = Trace()
    with tracer:
        yield tracer


def trace_each(modules) -> list[Trace]:
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

"""One vantage point at the dispatch level that every hp diagnostic watches through.

`hp.comm.trace()`, `hp.explain` and `hp.strict` want the same events: each op
on DTensors, with its inputs, outputs and the collectives DTensor issued to
run it, and each collective issued outside any such op (`hp.constrain`,
FSDP, a kernel of hp's own). Were each its own dispatch mode, they would hide
events from one another: a mode that lets DTensor desugar an op keeps the
modes below it from ever seeing that op. So there is one dispatch mode, the
hub, per place in the dispatch stack where hp watches (plain, or above
`LocalTensorMode` under `hp.simulated`), and the diagnostics are `Observer`s
subscribed to it. The hub sees each DTensor op once, runs it while collecting
the local collectives it issues, and hands the same event to every active
observer, whatever order they were entered in; an error an observer raises
(strict's verdict) waits until all of them have seen the event. A hub lower
in the stack stays quiet while one above reports, so nothing counts twice.

Kernels of hp's own (`kernel_scope`) tell observers when they start and end,
so that the collectives they run are shown as theirs, i.e. as asked for.

Collectives are recognised here too: kind, payload, mesh axis and bytes one
rank sends under ring algorithms (`hp.cost.ring_bytes`, whose docstring gives
the formulas; each rank receives as many as it sends).
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from hp.cost import ring_bytes
from hp.mesh import axis_of_group
from hp.source import in_backward, user_line


@dataclass(frozen=True)
class Collective:
    """One collective as one rank sees it."""

    kind: str
    axis: str
    group_size: int
    payload_bytes: int  # N in hp.cost.ring_bytes
    bytes: int  # sent (= received) by one rank
    phase: str  # "forward" or "backward"
    source: str


@dataclass(frozen=True)
class OpEvent:
    """An op that ran: one on DTensors, with the collectives DTensor issued to run it, or a
    collective on local tensors (no DTensor inputs or outputs; `collectives` is itself)."""

    op: str
    inputs: list[DTensor]
    outputs: list[DTensor]
    collectives: list[Collective]
    phase: str
    source: str


class Observer:
    """A diagnostic that sees every event while it is entered (as a context manager).

    Subclasses override the `on_*` methods they need; the defaults ignore the event.

    >>> import hp, torch
    >>> class Ops(Observer):
    ...     def __init__(self):
    ...         self.seen = []
    ...     def on_op(self, event):
    ...         self.seen.append((event.op, len(event.collectives)))
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh), Ops() as ops:
    ...     x = hp.shard(torch.ones(4, 2), "b/tp h", mesh)
    ...     y = x + hp.shard(torch.ones(4, 2), "b h/tp", mesh)  # DTensor moves one operand
    >>> ops.seen[-1]
    ('aten.add.Tensor', 1)
    """

    _hub: _Hub | None = None

    def __enter__(self):
        top = _get_current_dispatch_mode()
        self._hub = None if isinstance(top, _Hub) else _Hub()
        if self._hub is not None:
            self._hub.__enter__()
        _OBSERVERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OBSERVERS.remove(self)
        if self._hub is not None:
            self._hub.__exit__(*exc)
            self._hub = None

    def on_op(self, event: OpEvent) -> None:
        """An op on DTensors ran (inside a kernel of hp's own too)."""

    def on_collective(self, event: OpEvent) -> None:
        """A collective ran on local tensors, outside any op on DTensors."""

    def begin_kernel(self, name: str, inputs: list) -> object:
        """A kernel of hp's own starts (see `kernel_scope`); returns a handle for `end_kernel`."""

    def end_kernel(self, handle, outputs: list) -> None:
        """The kernel of `handle` ended with `outputs` ([NotImplemented]: it declined; []: it raised)."""


_OBSERVERS: list[Observer] = []  # entered and not yet exited, in entry order
_QUIET = threading.local()  # .depth > 0: a hub above is reporting the event under way


def hub_on_top() -> AbstractContextManager:
    """A hub on top of the dispatch stack while observers are active, else nothing.

    A mode pushed under active observers (`hp.simulated`'s LocalTensorMode)
    would otherwise take every op before their hub sees it.
    """
    return _Hub() if _OBSERVERS else nullcontext()


@contextmanager
def kernel_scope(name: str, inputs: list) -> Iterator[list]:
    """Tell the active observers that a kernel of hp's own runs inside; append its result.

    >>> with kernel_scope("double", [2]) as result:
    ...     result.append(2 * 2)
    >>> result
    [4]
    """
    opened = [(observer, observer.begin_kernel(name, inputs)) for observer in list(_OBSERVERS)]
    outputs: list = []
    try:
        yield outputs
    finally:
        for observer, handle in opened:
            observer.end_kernel(handle, outputs)


def run_kernel(kernel: Callable, args: tuple, kwargs: dict):
    """`kernel(*args, **kwargs)`, inside a `kernel_scope` only while observers are active.

    >>> run_kernel(lambda x: x + 1, (1,), {})
    2
    """
    if not _OBSERVERS:
        return kernel(*args, **kwargs)
    with kernel_scope(getattr(kernel, "__name__", "kernel"), tree_flatten((args, kwargs))[0]) as result:
        result.append(kernel(*args, **kwargs))
    return result[0]


def _deliver(notify: Callable[[Observer], None]) -> None:
    """Every active observer sees the event before the first error any of them raised propagates."""
    errors = []
    for observer in _OBSERVERS:
        try:
            notify(observer)
        except Exception as e:  # noqa: BLE001  re-raised below, once all have seen the event
            errors.append(e)
    if errors:
        raise errors[0]


@contextmanager
def _quiet() -> Iterator[None]:
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


class _Hub(TorchDispatchMode):
    """The one dispatch mode at its place in the stack that reports events to all observers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_QUIET, "depth", 0):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return _run_op(func, args, kwargs)
        collective = recognise(func, args)
        if collective is None:
            return func(*args, **kwargs)
        with _quiet():
            out = func(*args, **kwargs)
        event = OpEvent(str(func), [], [], [collective], collective.phase, collective.source)
        _deliver(lambda observer: observer.on_collective(event))
        return out


class _Collecting(TorchDispatchMode):
    """Entered while the hub runs an op on DTensors: notes the collectives DTensor issues for it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar; its local collectives come back here
        collective = recognise(func, args)
        if collective is not None:
            self.records.append(collective)
        return func(*args, **(kwargs or {}))


def _run_op(func, args, kwargs):
    with _quiet(), _Collecting() as collected:
        out = func(*args, **kwargs)
    event = OpEvent(
        op=str(func),
        inputs=[a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)],
        outputs=[o for o in tree_flatten(out)[0] if isinstance(o, DTensor)],
        collectives=collected.records,
        phase=_phase(),
        source=user_line(),
    )
    _deliver(lambda observer: observer.on_op(event))
    return out


def _phase() -> str:
    return "backward" if in_backward() else "forward"


# -- recognising collectives ------------------------------------------------


def recognise(func, args) -> Collective | None:
    """The collective that calling `func(*args)` issues, or None for any other op.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=4, simulate=True)
    >>> c = recognise(torch.ops._c10d_functional.all_reduce.default,
    ...               (torch.ones(8), "sum", mesh.get_group("tp").group_name))
    >>> c.kind, c.axis, c.payload_bytes, c.bytes
    ('all_reduce', 'tp', 32, 48)
    """
    if not isinstance(func, torch._ops.OpOverload):
        return None
    table = _TABLES.get(func.namespace)
    if table is None or func._opname not in table:
        return None
    kind, payload, group, *sent = table[func._opname](args)
    standing_for = _COUNTED_AS.get()
    if standing_for is not None:  # the collective realises another one, whose ring bytes it moves
        kind, sent = standing_for, []
    axis, p = _group(group)
    return Collective(
        kind=kind,
        axis=axis,
        group_size=p,
        payload_bytes=payload,
        bytes=sent[0] if sent else ring_bytes(kind, payload, p),
        phase=_phase(),
        source=user_line(),
    )


_COUNTED_AS: contextvars.ContextVar[str | None] = contextvars.ContextVar("hp_counted_as", default=None)


@contextmanager
def counted_as(kind: str) -> Iterator[None]:
    """Collectives issued inside are counted as `kind`, the collective they realise.

    hp's gloo reduce-scatter is one all-to-all of the same input (`hp.ops.collectives`): it
    sends the bytes a ring reduce-scatter sends, and a trace should name what was asked for.
    """
    token = _COUNTED_AS.set(kind)
    try:
        yield
    finally:
        _COUNTED_AS.reset(token)


def _nbytes(t: torch.Tensor) -> int:
    return _one_rank([t.numel()])[0] * t.element_size()


def _group(ref) -> tuple[str, int]:
    """(mesh axis, size) of a process group given by name or object."""
    pg = _process_group(ref)
    axis = axis_of_group(pg.group_name)
    if axis is None:
        desc = getattr(pg, "group_desc", "") or ""
        axis = desc.removeprefix("mesh_") if desc.startswith("mesh_") else "world"
    return axis, pg.size()


def _process_group(ref):
    """The process group a collective's arguments name: by name, as an object, or boxed (c10d ops carry it boxed)."""
    pg = _resolve_process_group(ref) if isinstance(ref, str) else ref
    if isinstance(pg, torch.ScriptObject):
        pg = torch.distributed.ProcessGroup.unbox(pg)
    return pg


def _one_rank(sizes) -> list[int]:
    """Split sizes as the first simulated rank sees them (per-rank SymInts under LocalTensorMode)."""
    out = []
    for n in sizes:
        node = getattr(n, "node", None)
        local = getattr(node, "_local_ints", None)
        out.append(int(local[min(local)]) if local else int(getattr(node, "val", n)))
    return out


def _all_to_all(t: torch.Tensor, input_splits, group):
    """An all-to-all; one that sends to a single peer (a ring shift) is a `send_recv` of what it sends.

    With split sizes (uneven ones: expert-parallel dispatch), a rank sends exactly the rows
    split off for the other ranks; the ring formula holds only for even splits.
    """
    splits = _one_rank(input_splits or [])
    # a row's size from the trailing dims: a simulated rank may hold no rows at all
    row_bytes = t.element_size() * math.prod(_one_rank(t.shape[1:]))
    own = splits[_rank_in(group)] if splits else 0
    if sum(1 for n in splits if n) == 1 and not own:  # rows that stay home are not sent
        return "send_recv", row_bytes * max(splits), group
    if splits:
        return "all_to_all", _nbytes(t), group, row_bytes * (sum(splits) - own)
    return "all_to_all", _nbytes(t), group


def _rank_in(ref) -> int:
    """This process's rank in a group given by name or object (the first simulated rank's, simulated)."""
    return max(_process_group(ref).rank(), 0)


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
    "alltoall_base_": lambda a: _all_to_all(a[1], a[4], a[2]),
    "broadcast_": lambda a: ("broadcast", sum(map(_nbytes, a[0])), a[1]),
    "scatter_": lambda a: ("scatter", sum(map(_nbytes, a[0])) * len(a[1][0]) if a[1] else 0, a[2]),
}
_TABLES = {"_c10d_functional": _FUNCTIONAL, "_dtensor": _FUNCTIONAL, "c10d": _C10D}

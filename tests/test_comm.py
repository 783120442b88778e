"""hp.comm.trace(): kinds, mesh axes, ring-algorithm bytes, phases and source lines."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hp
from hp.cost import ring_bytes


def _moved(src, dst, shape=(8, 4), axes=(("dp", 2), ("tp", 2))):
    mesh = hp.mesh(list(axes), simulate=True)
    with hp.simulated(mesh):
        x = hp.shard(torch.randn(shape), src, mesh)
        with hp.comm.trace() as t:
            hp.constrain(x, dst)
    return t


@pytest.mark.parametrize(
    "src, dst, kind, payload",
    [
        ("b h +tp", "b h", "all_reduce", 8 * 4 * 4),
        ("b/tp h", "b h", "all_gather", 8 * 4 * 4),  # payload: the gathered tensor
        ("b h +tp", "b/tp h", "reduce_scatter", 8 * 4 * 4),  # payload: the summed input
        ("b/tp h", "b h/tp", "all_to_all", 4 * 4 * 4),  # payload: the rank's input
        ("b h +dp", "b h", "all_reduce", 8 * 4 * 4),
    ],
)
def test_each_redistribution_is_one_collective_with_ring_bytes(src, dst, kind, payload):
    t = _moved(src, dst)
    axis = "dp" if "dp" in src else "tp"
    assert [(r.kind, r.axis, r.payload_bytes) for r in t.records] == [(kind, axis, payload)]
    assert t.bytes() == ring_bytes(kind, payload, 2)


@given(st.integers(2, 5), st.integers(1, 4), st.integers(1, 3))
def test_all_reduce_bytes_follow_the_ring_formula(p, rows, cols):
    t = _moved("b h +tp", "b h", shape=(rows * p, cols), axes=(("tp", p),))
    n = rows * p * cols * 4
    assert t.count("all_reduce", axis="tp") == 1
    assert t.bytes("all_reduce") == 2 * (p - 1) * n // p


def test_ring_formulas():
    assert ring_bytes("all_reduce", 1200, 4) == 1800
    assert ring_bytes("all_gather", 1200, 4) == 900
    assert ring_bytes("reduce_scatter", 1200, 3) == 800
    assert ring_bytes("all_to_all", 1200, 4) == 900
    assert ring_bytes("all_reduce", 1200, 1) == 0


def test_phases_sources_and_reports():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        x = hp.shard(torch.randn(4, 6), "b h/tp", mesh).requires_grad_()
        with hp.comm.trace() as t:
            y = hp.constrain(x, "b h")  # forward: all-gather
            y.sum().backward()  # backward: nothing to move (replicate -> shard is local)
            z = hp.constrain(x.detach(), "b h")  # a forward after a backward in one trace
    assert t.count(phase="forward") == 2 and t.count(phase="backward") == 0
    assert all(r.source.startswith("test_comm.py:") for r in t.records)
    assert t.per_axis() == {"tp": {"all_gather": 2 * ring_bytes("all_gather", 96, 2)}}
    assert "all_gather" in t.table() and "test_comm.py" in t.table()
    assert len(json.loads(t.to_json())["collectives"]) == 2
    assert z.shape == (4, 6)


def test_backward_collectives_are_marked():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        x = hp.shard(torch.randn(4, 6), "b h", mesh).requires_grad_()
        with hp.comm.trace() as t:
            y = hp.constrain(x, "b h/tp")
            (y * hp.shard(torch.randn(4, 6), "b h/tp", mesh)).sum().backward()
    assert t.count(phase="forward") == 0
    assert t.count("all_gather", phase="backward") == 1  # the gradient of a split is a gather


def test_trace_outside_or_inside_simulation_sees_the_same():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.comm.trace() as outer, hp.simulated(mesh):
        x = hp.shard(torch.randn(4, 6), "b h +tp", mesh)
        with hp.comm.trace() as inner:
            hp.constrain(x, "b h")
    assert outer.count("all_reduce") == inner.count("all_reduce") == 1


def test_fake_backend_counts_without_data():
    mesh = hp.mesh(tp=64, simulate=True)  # no LocalTensorMode: shapes only
    x = hp.shard(torch.randn(64, 128), "b h +tp", mesh)
    with hp.comm.trace() as t:
        hp.constrain(x, "b/tp h")
    assert t.count("reduce_scatter", axis="tp") == 1
    assert t.bytes() == 63 * 64 * 128 * 4 // 64


class _PassThrough(TorchDispatchMode):
    """A dispatch mode of someone else's, between two of hp's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_traces_on_either_side_of_another_dispatch_mode_count_each_collective_once():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        a = hp.shard(torch.randn(4, 6), "b/tp h", mesh)
        b = hp.shard(torch.randn(4, 6), "b h/tp", mesh)
        with hp.comm.trace() as outer, _PassThrough(), hp.comm.trace() as inner:
            hp.constrain(a, "b h")  # one all-gather, outside any op
            a + b  # DTensor moves an operand inside the add
    assert outer.records == inner.records
    assert outer.count("all_gather") == 1 and outer.count() == 2

"""`hp.mpmd`: pipelined MoE and Llama steps give the plain step's loss, gradients and bytes moved; the planner.

Pipelined routing itself, row by row on drawn routings and chunk counts, is tested with the plain one in
tests/test_moe.py; the pipelined tensor-parallel linears are drawn here on a residual block.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import batch, rel_err, tiny_pair
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp
from hp.cost import ring_bytes
from hp.models import plan_for
from hp.ops import overlap


def _step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss


@pytest.mark.parametrize("strategy", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}], ids=["ep2", "ep2-tp2"])
def test_a_pipelined_moe_step_gives_hf_s_loss_and_gradients_and_the_plain_step_s_rows(strategy):
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
    reference, plain = tiny_pair("qwen3_moe", layers=1, **aux)
    piped = tiny_pair("qwen3_moe", layers=1, **aux)[1]
    ids, labels = batch()
    hf_loss = _step(reference, ids, labels).item()  # the unsharded model's
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        traces = []
        for model, run in ((plain, _step), (piped, hp.mpmd(_step, chunks=2))):
            hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
            for _ in range(3):  # warm-up, the step as it is measured, then pipelined
                model.zero_grad(set_to_none=True)
                with hp.comm.trace() as trace:
                    loss = run(model, ids, labels)
            hp.reduce_gradients(model)
            traces.append((loss, trace))
        (want, plain_trace), (got, piped_trace) = traces
        assert run.plan.chunks == 2 and run.report.chunks == 2
        assert abs(got.full_tensor().item() - want.full_tensor().item()) <= 1e-5 * abs(want.full_tensor().item())
        assert abs(got.full_tensor().item() - hf_loss) <= 1e-5 * abs(hf_loss)
        for (name, p), q, r in zip(piped.named_parameters(), plain.parameters(), reference.parameters()):
            assert rel_err(p.grad.full_tensor(), q.grad.full_tensor()) < 1e-5, name
            assert rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
    layers, experts = plain.config.num_hidden_layers, plain.config.num_experts
    counts = layers * experts // 2 * 8  # per layer, half the int64 counts go to the other rank
    rows = plain_trace.bytes("all_to_all", axis="ep") - counts
    assert piped_trace.bytes("all_to_all", axis="ep") == rows + 2 * counts  # the same rows; one count per chunk
    for kind in ("all_gather", "reduce_scatter"):
        assert piped_trace.bytes(kind) == plain_trace.bytes(kind), kind
    # the plan's: the slowest rank's step time, one float64 over the world (a simulated one may hold more ranks)
    plan = ring_bytes("all_reduce", 8, torch.distributed.get_world_size())
    assert piped_trace.bytes("all_reduce") == plain_trace.bytes("all_reduce") + plan


@pytest.mark.parametrize("strategy, chunks", [({"tp": 2}, 2), ({"tp": 2, "sp": True}, 3),
                                              ({"dp": 2, "tp": 2, "sp": True}, 2), ({"cp": 2, "tp": 2, "sp": True}, 2)],
                         ids=["tp2", "tp2-sp", "dp2-tp2-sp", "cp2-tp2-sp"])
def test_a_pipelined_llama_step_gives_hf_s_loss_and_gradients_and_the_plain_step_s_bytes(strategy, chunks):
    reference, plain = tiny_pair("llama", layers=1)
    piped = tiny_pair("llama", layers=1)[1]
    ids, labels = batch()
    want = _step(reference, ids, labels).item()  # the unsharded model's
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        traces = []
        for model, run in ((plain, _step), (piped, hp.mpmd(_step, chunks=chunks))):
            hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                with hp.comm.trace() as trace:
                    loss = run(model, ids, labels)
            hp.reduce_gradients(model)
            traces.append(trace)
            assert abs(loss.full_tensor().item() - want) <= 1e-5 * want
        assert run.report.chunks == chunks
        for (name, p), q, r in zip(piped.named_parameters(), plain.parameters(), reference.parameters()):
            assert rel_err(p.grad.full_tensor(), q.grad.full_tensor()) < 1e-5, name
            assert rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
    plain_trace, piped_trace = traces
    for kind in ("all_gather", "reduce_scatter"):
        assert piped_trace.bytes(kind) == plain_trace.bytes(kind), kind
    pipelined = ("reduce_scatter", "tp") if strategy.sp else ("all_reduce", "tp")
    assert piped_trace.count(*pipelined) > plain_trace.count(*pipelined)  # sent in pieces
    plan = ring_bytes("all_reduce", 8, torch.distributed.get_world_size())  # the planner's one float64, over the world
    assert piped_trace.bytes("all_reduce") == plain_trace.bytes("all_reduce") + plan


class _Mlp(nn.Module):
    """A residual gated MLP: two column-parallel linears share an input, a row-parallel one adds to the stream."""

    def __init__(self, hidden: int, width: int, bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=bias)
        self.up = nn.Linear(hidden, width, bias=bias)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([2, 4]), batch_size=st.integers(1, 2), per_rank=st.integers(1, 5),
       chunks=st.integers(1, 4), sp=st.booleans(), bias=st.booleans())
def test_pipelined_tensor_parallel_linears_give_the_plain_values_gradients_and_bytes(
        tp, batch_size, per_rank, chunks, sp, bias):
    torch.manual_seed(0)
    reference = _Mlp(8, 16, bias)
    x = torch.randn(batch_size, tp * per_rank, 8, requires_grad=True)
    (reference(x) ** 2).sum().backward()
    stream = "b s/tp h" if sp else "b s h"
    plan = {"gate.weight": "out/tp in", "up.weight": "out/tp in", "down.weight": "out in/tp",
            **({"gate.bias": "out/tp", "up.bias": "out/tp"} if bias else {})}
    mesh = hp.mesh(tp=tp, simulate=True)
    with hp.simulated(mesh):
        results = []
        for pipelined in (False, True):
            model = _Mlp(8, 16, bias)
            model.load_state_dict(reference.state_dict())
            hp.parallelize(model, mesh, plan, inputs={"": stream}, outputs={"down": stream})
            inputs = hp.shard(x.detach(), stream, mesh).requires_grad_()
            with hp.comm.trace() as trace, overlap.pipelined(chunks) if pipelined else _nothing():
                out = model(inputs)
                (out ** 2).sum().backward()
            assert out.placements == ((Shard(1),) if sp else (Replicate(),))
            results.append((out, model, inputs, trace))
    (plain_out, plain, plain_x, plain_trace), (out, model, inputs, trace) = results
    assert rel_err(out.full_tensor(), plain_out.full_tensor()) < 1e-6
    assert rel_err(inputs.grad.full_tensor(), x.grad) < 1e-5
    for name, p in model.named_parameters():
        assert rel_err(p.grad.full_tensor(), reference.get_parameter(name).grad) < 1e-5, name
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert trace.bytes(kind) == plain_trace.bytes(kind), kind
    pieces = min(chunks, per_rank if sp else tp * per_rank)  # each collective goes out in that many calls
    for kind in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
        assert trace.count(kind) == pieces * plain_trace.count(kind) > 0, kind


def _nothing():
    from contextlib import nullcontext  # noqa: PLC0415

    return nullcontext()


def test_the_planner_keeps_a_step_that_chunking_slows_down_and_says_why():
    def step():  # slower when pipelined, as a step of tiny layers is
        time.sleep(0.05 if overlap.chunks() > 1 else 0.0)
        return overlap.chunks()

    planned = hp.mpmd(step, chunks="auto")
    assert [planned() for _ in range(4)] == [1, 1, 2, 1]
    assert planned.plan.chunks == 1 and "too small to pay for chunking" in planned.plan.reason
    forced = hp.mpmd(step, chunks=3)
    assert [forced() for _ in range(4)] == [1, 1, 3, 3] and forced.plan.reason == ""
    assert [c for c, _ in forced.plan.tried] == [1, 3]


@pytest.mark.parametrize("fastest", [2, 4, 8])
def test_auto_tries_more_chunks_while_they_make_the_step_faster_and_keeps_the_fastest(fastest):
    def step():  # each doubling saves 50 ms up to `fastest` chunks and costs 50 ms past it (a loaded machine's
        c = overlap.chunks()  # sleeps wake tens of ms late)
        time.sleep(0.05 * (abs(c.bit_length() - fastest.bit_length()) + 1))
        return c

    planned = hp.mpmd(step, chunks="auto")
    trials = [1, 1] + [c for c in (2, 4, 8) if c <= min(2 * fastest, 8)]
    assert [planned() for _ in range(len(trials) + 2)] == trials + [fastest, fastest]
    assert planned.plan.chunks == fastest and planned.plan.reason == ""
    assert [c for c, _ in planned.plan.tried] == [1] + trials[2:]


@pytest.mark.parametrize("chunks, message", [(0, "chunks = 0: expected an integer >= 1, or 'auto'"),
                                             ("many", "chunks = 'many'"), (True, "chunks = True")])
def test_bad_chunks_are_refused(chunks, message):
    with pytest.raises(hp.MpmdError, match=message):
        hp.mpmd(lambda: None, chunks=chunks)



def test_a_timeline_is_drawn_or_the_plot_extra_is_named(tmp_path):
    from hp.mpmd.timeline import Timeline, draw  # noqa: PLC0415
    from hp.ops.overlap import Span  # noqa: PLC0415

    lines = [Timeline(r, 1.0, (Span("all_gather", 0.1, 0.3, 0.4), Span("reduce_scatter", 0.35, 0.6, 0.7))) for r in (0, 1)]
    assert lines[0].flight_seconds == pytest.approx(0.6) and lines[0].exposed_seconds == pytest.approx(0.2)
    path = tmp_path / "timeline.png"
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'hp\[plot\]'"):
            draw(lines, str(path))
        return
    draw(lines, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_collective_that_landed_before_its_wait_flew_until_it_landed_and_was_not_waited_on():
    from hp.mpmd.timeline import Timeline  # noqa: PLC0415
    from hp.ops.overlap import Span  # noqa: PLC0415

    early = Timeline(0, 1.0, (Span("all_reduce", 0.1, 0.6, 0.4), Span("all_gather", 0.5, 0.7, 0.8)))
    assert early.flight_seconds == pytest.approx(0.3 + 0.3)  # 0.1-0.4 and 0.5-0.8
    assert early.exposed_seconds == pytest.approx(0.1)  # only the gather's 0.7-0.8
    assert early.masking == pytest.approx(0.5 / 0.6)


def test_peer_waits_need_the_ranks_of_one_group():
    from hp.mpmd.timeline import Timeline, waiting_for_peers  # noqa: PLC0415
    from hp.ops.overlap import Span  # noqa: PLC0415

    gather, reduce = Span("all_gather", 0.1, 0.2, 0.3), Span("reduce_scatter", 0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="different collectives"):
        waiting_for_peers([Timeline(0, 1.0, (gather,)), Timeline(1, 1.0, (reduce,))])
    # rank 1 started 0.15 s later: rank 0 waited from 0.2 to 0.25 for it, then 0.05 s for the transfer
    both = waiting_for_peers([Timeline(0, 1.0, (gather,), started=5.0), Timeline(1, 1.0, (gather,), started=5.15)])
    assert both == pytest.approx([0.05, 0.0])


def test_drawing_before_a_step_is_refused():
    with pytest.raises(hp.MpmdError, match="no step has run yet"):
        hp.mpmd(lambda: None).draw("never.png")

"""`hp.mpmd`: a pipelined MoE step gives the plain step's loss, gradients and rows moved; the planner.

Pipelined routing itself, row by row on drawn routings and chunk counts, is tested with the plain one in
tests/test_moe.py.
"""

from __future__ import annotations

import time

import pytest
from reference import batch, rel_err, tiny_pair

import hp
from hp.cost import ring_bytes
from hp.models import plan_for
from hp.ops import overlap


def _moe_step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss


@pytest.mark.parametrize("strategy", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}], ids=["ep2", "ep2-tp2"])
def test_a_pipelined_moe_step_gives_the_plain_step_s_loss_gradients_and_rows(strategy):
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
    plain, piped = tiny_pair("qwen3_moe", layers=1, **aux)
    ids, labels = batch()
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        traces = []
        for model, run in ((plain, _moe_step), (piped, hp.mpmd(_moe_step, chunks=2))):
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
        for (name, p), q in zip(piped.named_parameters(), plain.parameters()):
            assert rel_err(p.grad.full_tensor(), q.grad.full_tensor()) < 1e-5, name
    layers, experts = plain.config.num_hidden_layers, plain.config.num_experts
    counts = layers * experts // 2 * 8  # per layer, half the int64 counts go to the other rank
    rows = plain_trace.bytes("all_to_all", axis="ep") - counts
    assert piped_trace.bytes("all_to_all", axis="ep") == rows + 2 * counts  # the same rows; one count per chunk
    for kind in ("all_gather", "reduce_scatter"):
        assert piped_trace.bytes(kind) == plain_trace.bytes(kind), kind
    plan = ring_bytes("all_reduce", 8, strategy.world_size)  # the plan's: the slowest rank's step time, one float64
    assert piped_trace.bytes("all_reduce") == plain_trace.bytes("all_reduce") + plan


def test_a_dense_step_runs_as_it_is_and_hides_what_it_has():
    reference, model = tiny_pair("llama")
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss
    strategy = hp.Strategy(tp=2, sp=True)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        step = hp.mpmd(lambda: model(input_ids=ids, labels=labels).loss, chunks="auto")
        losses = [step().full_tensor().item() for _ in range(4)]
    assert all(abs(loss - want.item()) <= 1e-5 * want.item() for loss in losses)
    assert step.report.exposed_seconds == 0 and step.report.masking == 1.0


def test_the_planner_keeps_a_step_that_chunking_slows_down_and_says_why():
    def step():  # slower when pipelined, as a step of tiny layers is
        time.sleep(0.05 if overlap.chunks() > 1 else 0.0)
        return overlap.chunks()

    planned = hp.mpmd(step, chunks="auto")
    assert [planned() for _ in range(4)] == [1, 1, 2, 1]
    assert planned.plan.chunks == 1 and "too small to pay for chunking" in planned.plan.reason
    forced = hp.mpmd(step, chunks=3)
    assert [forced() for _ in range(4)] == [1, 1, 3, 3] and forced.plan.reason == ""


@pytest.mark.parametrize("chunks, message", [(0, "chunks = 0: expected an integer >= 1, or 'auto'"),
                                             ("many", "chunks = 'many'")])
def test_bad_chunks_are_refused(chunks, message):
    with pytest.raises(hp.MpmdError, match=message):
        hp.mpmd(lambda: None, chunks=chunks)

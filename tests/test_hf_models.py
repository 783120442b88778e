"""HF Llama and Qwen3 run tensor-parallel with layouts on their weights only (`hp.parallelize`, no strategy).

Loss and every gradient match the unsharded HF model, and each decoder layer
communicates exactly two all-reduces in forward with the ring formula's bytes;
the example script does the same over two real gloo processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rank_pool
from gloo_launch import assert_finished
from reference import assert_same_loss_and_grads, batch, tiny_pair

import hp
from hp.cost import ring_bytes
from hp.models.llama import TP_PLAN

EXAMPLE = Path(__file__).parent.parent / "examples" / "annotate_llama.py"


@pytest.mark.parametrize("family, tp", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4)])
def test_weights_only_tp_matches_hf_with_two_allreduces_per_layer(family, tp):
    reference, model = tiny_pair(family)
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    mesh = hp.mesh(tp=tp, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, TP_PLAN)
        layers = hp.comm.trace_each(model.model.layers)
        got = model(input_ids=ids, labels=labels).loss
        got.backward()
        assert_same_loss_and_grads(got, want, model, reference)
    megatron = 2 * ring_bytes("all_reduce", ids.numel() * 64 * 4, tp)  # 2 (p-1)/p * T * h * 4 bytes, twice
    for trace in layers:
        forward = trace.select(phase="forward")
        assert [r.kind for r in forward] == ["all_reduce", "all_reduce"]
        assert trace.bytes(phase="forward") == megatron


def test_two_gloo_processes_match_hf():
    run = rank_pool.run(str(EXAMPLE), 2, "--seq", "16")
    assert_finished(run)
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["tp"] == 2 and r["loss_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-5
    assert r["fwd_allreduce_per_layer"] == [2, 2] and r["fwd_other_collectives_per_layer"] == [0, 0]
    assert r["fwd_bytes_per_layer_per_rank"] == [r["ring_formula_bytes_per_layer_per_rank"]] * 2

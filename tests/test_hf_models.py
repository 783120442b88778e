"""HF Llama and Qwen3 run tensor-parallel with layouts on their weights only.

Loss and every gradient match the unsharded HF model, and each decoder layer
communicates exactly two all-reduces in forward with the ring formula's bytes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from gloo_launch import assert_finished, torchrun

import hp

EXAMPLE = Path(__file__).parent.parent / "examples" / "annotate_llama.py"
_spec = importlib.util.spec_from_file_location("annotate_llama", EXAMPLE)
annotate_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(annotate_llama)


@pytest.mark.parametrize("kind, tp", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4)])
def test_weights_only_tp_matches_hf_with_two_allreduces_per_layer(kind, tp):
    mesh = hp.mesh(tp=tp, simulate=True)
    with hp.simulated(mesh):
        r = annotate_llama.run(kind, mesh, layers=2, batch=2, seq=16)
    assert r["loss_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-5, r
    assert r["fwd_allreduce_per_layer"] == [2, 2]
    assert r["fwd_other_collectives_per_layer"] == [0, 0]
    assert r["fwd_bytes_per_layer_per_rank"] == [r["ring_formula_bytes_per_layer_per_rank"]] * 2
    # 2 (p-1)/p * T * h * 4 bytes, twice per layer
    assert r["ring_formula_bytes_per_layer_per_rank"] == 2 * (2 * (tp - 1) * 2 * 16 * 64 * 4 // tp)


def test_two_gloo_processes_match_hf():
    run = torchrun(str(EXAMPLE), 2, "--seq", "16")
    assert_finished(run)
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["tp"] == 2 and r["loss_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-5
    assert r["fwd_allreduce_per_layer"] == [2, 2] and r["fwd_other_collectives_per_layer"] == [0, 0]
    assert r["fwd_bytes_per_layer_per_rank"] == [r["ring_formula_bytes_per_layer_per_rank"]] * 2

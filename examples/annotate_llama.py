"""Tensor-parallel HF Llama (or Qwen3) by annotating its weights only.

Builds a tiny `LlamaForCausalLM` from a config in code, lays out its weights
Megatron-style (column-parallel q, k, v, gate, up; row-parallel o, down; the
LM head split over the vocabulary, so the loss runs vocab-parallel), runs
forward and backward, and compares loss and every gradient with the
unsharded model. The model code is HF's, unchanged. Prints one JSON object
as its last line.

    python examples/annotate_llama.py --simulate 2            # 2 ranks in one process
    torchrun --nproc-per-node 2 examples/annotate_llama.py    # real processes
    python examples/annotate_llama.py --simulate 4 --model qwen3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import hp
from hp.comm import trace_each
from hp.cost import ring_bytes
from hp.models import tiny_config
from hp.models.llama import TP_PLAN  # Megatron layouts of the Llama weights, written out there

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import rel_err, tp_mesh  # noqa: E402  (the examples' shared helpers)

def tiny_model(kind: str, layers: int):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(kind, layers=layers))


def run(kind: str, mesh, layers: int = 2, batch: int = 2, seq: int = 32) -> dict:
    """Parallelize, run forward + backward, compare with one device; the JSON result."""
    torch.manual_seed(0)
    reference = tiny_model(kind, layers)
    model = tiny_model(kind, layers)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, reference.config.vocab_size, (batch, seq))
    labels = ids.clone()
    labels[:, :3] = -100  # ignored positions must stay ignored

    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()

    hp.parallelize(model, mesh, TP_PLAN)
    per_layer = trace_each(model.model.layers)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    value = loss.detach().full_tensor().item()
    grads = {
        name: rel_err(p.grad.full_tensor(), r.grad)
        for (name, p), r in zip(model.named_parameters(), reference.parameters())
    }
    p, h, tokens = mesh.size(), reference.config.hidden_size, batch * seq
    forward = [t.select(phase="forward") for t in per_layer]
    return {
        "model": kind,
        "tp": p,
        "loss": value,
        "loss_rel_err": abs(value - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel_err": max(grads.values()),
        "fwd_allreduce_per_layer": [sum(r.kind == "all_reduce" for r in f) for f in forward],
        "fwd_other_collectives_per_layer": [sum(r.kind != "all_reduce" for r in f) for f in forward],
        "fwd_bytes_per_layer_per_rank": [sum(r.bytes for r in f) for f in forward],
        "ring_formula_bytes_per_layer_per_rank": 2 * ring_bytes("all_reduce", tokens * h * 4, p),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, default=0, help="simulate this many tp ranks in one process")
    parser.add_argument("--model", choices=["llama", "qwen3"], default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    mesh, ranks = tp_mesh(args.simulate)
    with ranks:
        result = run(args.model, mesh, args.layers, args.batch, args.seq)
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

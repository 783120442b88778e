"""Worker for test_gloo.py: the reference Llama strategies on 4 real gloo processes.

(dp=2, tp=2), (dp=2 fsdp, tp=2), (cp=4) Ulysses and (cp=4) ring: loss and every gradient equal the unsharded HF model,
and 5 AdamW steps give its losses. Every check raises on failure.
"""

from __future__ import annotations

import importlib.util
import os

import torch

import hp
from hp.models.llama import parallelize_llama, reduce_gradients, strategy_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_model():
    spec = importlib.util.spec_from_file_location("annotate_llama", os.path.join(ROOT, "examples", "annotate_llama.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.tiny_model("llama", 1)


def check(strategy: dict, rank: int) -> None:
    torch.manual_seed(0)
    reference, model = tiny_model(), tiny_model()
    model.load_state_dict(reference.state_dict())
    batches = [torch.randint(0, 256, (4, 16)) for _ in range(5)]
    mesh = strategy_mesh(strategy)
    parallelize_llama(model, mesh, strategy)
    if strategy.get("fsdp"):  # FSDP2 shards the tp blocks again over dp
        assert str(hp.layout_of(model.model.layers[0].self_attn.q_proj.weight)) == "64/tp/dp 64"
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, ids in enumerate(batches):
        labels = ids.clone()
        labels[:, :2] = -100
        labels[0, 2:9] = -100  # unevenly over the batch: the loss must divide by the global count
        want = reference(input_ids=ids, labels=labels).loss
        want.backward()
        got = model(input_ids=ids, labels=labels).loss
        got.backward()
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=f"{strategy} step {step}")
        if step == 0:
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"rank {rank} {strategy}: {name}")
        reduce_gradients(model)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def main() -> None:
    rank = int(os.environ["RANK"])
    strategies = ({"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "fsdp": True}, {"cp": 4}, {"cp": 4, "cp_algorithm": "ring"})
    for strategy in strategies:
        check(strategy, rank)
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()

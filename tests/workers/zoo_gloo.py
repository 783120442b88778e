"""Worker for test_gloo.py: the zoo's strategies on 4 real gloo processes.

Every family under (dp=2 fsdp, tp=2) (Llama with activation recompute, which
FSDP2 runs only here), and Llama under (dp=2, tp=2), (cp=4) Ulysses and (cp=4)
ring: loss and every gradient equal the unsharded HF model, and 5 AdamW steps
give its losses. Every check raises on failure.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

import hp
from hp.models import FAMILIES, plan_for, tiny_config


def tiny_pair(family: str):
    torch.manual_seed(0)
    config = tiny_config(family, layers=1)
    reference, model = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def check(family: str, strategy: dict, rank: int) -> None:
    reference, model = tiny_pair(family)
    batches = [torch.randint(0, 256, (4, 16)) for _ in range(5)]
    mesh = hp.strategy_mesh(strategy)
    hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
    if strategy.get("fsdp"):  # FSDP2 shards the tp blocks again over dp
        assert str(hp.layout_of(model.model.layers[0].mlp.down_proj.weight)) == "64/dp 128/tp"
    mlp_calls = []  # the block's MLP runs once per step, twice with recompute (again in backward)
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
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
        where = f"rank {rank} {family} {strategy} step {step}"
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=where)
        if step == 0:
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"{where}: {name}")
        runs = (2 if strategy.get("recompute") else 1) * (step + 1)
        assert len(mlp_calls) == runs, f"{where}: {len(mlp_calls)} MLP calls, expected {runs}"
        hp.reduce_gradients(model)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def main() -> None:
    rank = int(os.environ["RANK"])
    for family in FAMILIES:
        check(family, {"dp": 2, "tp": 2, "fsdp": True, "recompute": family == "llama"}, rank)
    for strategy in ({"dp": 2, "tp": 2}, {"cp": 4}, {"cp": 4, "cp_algorithm": "ring"}):
        check("llama", strategy, rank)
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()

"""Worker for test_offload.py: hp.offload on a TP-sharded Llama, 2 real gloo processes.

Two copies of a tiny Llama laid out alike (tp=2, then tp=2 with sequence parallel) take
the same AdamW steps, one under `hp.offload` at half its recorded peak: losses and every
gradient block must be bit-identical, the plan must meet its budget and move DTensor blocks.
Every check raises on failure, so a non-zero exit is a failed test.
"""

from __future__ import annotations

import torch

import hp
from hp.models import plan_for, tiny_config


def training(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor(), grads

    return step


def main() -> None:
    from transformers import AutoModelForCausalLM

    for strategy in ({"tp": 2}, {"tp": 2, "sp": True}):
        mesh = hp.strategy_mesh(strategy)
        config = tiny_config("llama", layers=2)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(hp.apply_strategy(AutoModelForCausalLM.from_config(config), mesh, strategy, plan_for(config)))
        plain = training(models[0])
        offloaded = hp.offload(training(models[1]), budget=0.5, modules=[models[1]])
        for s in range(3):
            ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(s))
            want_loss, want_grads = plain(ids)
            got_loss, got_grads = offloaded(ids)
            assert torch.equal(got_loss, want_loss), (strategy, s)
            for name, g in want_grads.items():
                assert torch.equal(got_grads[name], g), (strategy, s, name)
        plan, run = offloaded.plan(), offloaded.last_run
        assert plan.over_budget_bytes == 0 and plan.peak_after <= plan.budget_bytes < plan.peak_before, plan.table()
        assert run.bytes_offloaded == run.bytes_read_back == plan.offloaded_bytes > 0, run
    print(f"rank {torch.distributed.get_rank()} ok", flush=True)


if __name__ == "__main__":
    main()

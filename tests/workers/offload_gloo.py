"""Worker for test_offload.py: hp.offload on a TP-sharded Llama, 2 real gloo processes.

Two copies of a tiny Llama laid out alike (tp=2; tp=2 with sequence parallel, where the
planner may recompute decoder layers and a slow stated bandwidth makes it; dp=2 with FSDP,
its AdamW states in the tier between updates) take the same AdamW steps, one under
`hp.offload` at half its recorded peak: losses and every gradient block must be
bit-identical, the plan must meet its budget and move DTensor blocks. Two more
sequence-parallel runs compose it with `hp.mpmd` (around it, then inside it):
their steps equal the plain ones to fp32 rounding, pipelined from the third call.
Every check raises on failure, so a non-zero exit is a failed test.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

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
        loss = loss.detach()
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss), grads

    return step, opt


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Pipelined chunks multiply fewer rows at a time: equal to fp32 rounding, not bit for bit."""
    return bool((got - want).norm() <= 1e-5 * want.norm())


def main() -> None:
    from transformers import AutoModelForCausalLM

    sp = {"tp": 2, "sp": True}
    for strategy, mpmd in (({"tp": 2}, None), (sp, None), ({"dp": 2, "fsdp": True}, None), (sp, "around"), (sp, "inside")):
        mesh = hp.strategy_mesh(strategy)
        config = tiny_config("llama", layers=2)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(hp.apply_strategy(AutoModelForCausalLM.from_config(config), mesh, strategy, plan_for(config)))
        plain, _ = training(models[0])
        step, opt = training(models[1])
        options = ({"recompute": models[1].model.layers, "bandwidth": 1e6} if strategy.get("sp") and not mpmd
                   else {"optimizer": opt} if strategy.get("fsdp") else {})
        if mpmd == "inside":  # hp.offload of hp.mpmd: the pipelined calls save other tensors, recorded anew
            offloaded = hp.offload(hp.mpmd(step, chunks=2), budget=0.5, modules=[models[1]], **options)
            run_step, pipelined = offloaded, offloaded._step
        elif mpmd == "around":  # hp.mpmd of hp.offload
            offloaded = hp.offload(step, budget=0.5, modules=[models[1]], **options)
            run_step = pipelined = hp.mpmd(offloaded, chunks=2)
        else:
            run_step = offloaded = hp.offload(step, budget=0.5, modules=[models[1]], **options)
        same = _close if mpmd else torch.equal
        for s in range(6 if mpmd else 4):  # hp.mpmd pipelines from the third call
            ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(s))
            want_loss, want_grads = plain(ids)
            got_loss, got_grads = run_step(ids)
            assert same(got_loss, want_loss), (strategy, mpmd, s)
            for name, g in want_grads.items():
                assert same(got_grads[name], g), (strategy, mpmd, s, name)
        if mpmd:
            assert pipelined.report.chunks == 2, pipelined.report
        plan, run = offloaded.plan(), offloaded.last_run
        assert plan.over_budget_bytes == 0 and plan.peak_after <= plan.budget_bytes, plan.table()
        assert run.bytes_offloaded == run.bytes_read_back == plan.offloaded_bytes, (run, plan.table())
        if strategy.get("sp") and not mpmd:  # recomputing the layers left little to move
            assert plan.recompute, plan.table()
        else:
            assert plan.offloaded_bytes > 0, plan.table()
        if strategy.get("fsdp"):
            assert run.optimizer_bytes > 0, run
    print(f"rank {torch.distributed.get_rank()} ok", flush=True)


if __name__ == "__main__":
    main()

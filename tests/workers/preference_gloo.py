"""Preference stages over 2 gloo processes: 5 AdamW steps equal the unsharded computation's.

Run by tests/test_train_preference.py with torchrun (2 ranks). For DPO, KTO,
the reward model and DPO with LoRA under FSDP dp=2 (plain dp=2 on torch 2.11),
and DPO at cp=2 (ring) and KTO at tp=2, each rank builds the policy (and the frozen reference) twice from
one seed: one copy laid out, one whole, computing the same global batches.
Each step's loss must equal the unsharded one (fp32, relative 1e-5), and the
first step's gradients too.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

import hp
from hp.models import plan_for, tiny_config
from hp.train.config import Preference
from hp.train.data import collate
from hp.train.model import add_value_head
from hp.train.objectives import Dpo, Kto, Reference, Reward

DP = hp.Strategy(dp=2, fsdp=True)
CHECKS = [("dpo", False, DP), ("kto", False, DP), ("rm", False, DP), ("dpo", True, DP),
          ("dpo", False, hp.Strategy(cp=2, cp_algorithm="ring")), ("kto", False, hp.Strategy(tp=2))]


def pairs(step: int, count: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(count):
        prompt = torch.randint(0, 256, (3 + i,), generator=g).tolist()
        chosen = torch.randint(0, 256, (4 + i,), generator=g).tolist()
        rejected = torch.randint(0, 256, (6 - i,), generator=g).tolist()
        out.append({"chosen_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                    "rejected_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected})
    return out


def feedback(step: int) -> list[dict]:
    return [{"input_ids": e["chosen_ids"], "labels": e["chosen_labels"], "kl_input_ids": e["rejected_ids"],
             "kl_labels": e["rejected_labels"], "kto_tag": i % 2 == 0} for i, e in enumerate(pairs(step))]


def build(stage: str, lora: bool):
    """(policy, frozen reference) built from one seed, the policy moved off the reference."""
    config = tiny_config("llama", layers=1)
    torch.manual_seed(0)
    policy, frozen = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    frozen.load_state_dict(policy.state_dict())
    if lora:
        hp.add_lora(policy, hp.Lora(rank=4, targets=("q_proj", "v_proj", "down_proj")))
    if stage == "rm":
        add_value_head(policy, seed=1)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return policy, frozen.requires_grad_(False)


def objective(stage: str, policy, frozen, strategy, lora: bool):
    reference = Reference(policy, adapters=True) if lora else Reference(frozen)
    if stage == "dpo":
        return Dpo(policy, reference, strategy, Preference(ftx=0.5))
    if stage == "kto":
        return Kto(policy, reference, strategy, Preference())
    return Reward(policy, strategy)


def check(stage: str, lora: bool, strategy: hp.Strategy, rank: int) -> None:
    mesh = hp.strategy_mesh(strategy)
    whole, whole_ref = build(stage, lora)
    laid, laid_ref = build(stage, lora)
    for model in (laid, laid_ref):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
    want_step = objective(stage, whole, whole_ref, hp.Strategy(), lora)
    got_step = objective(stage, laid, laid_ref, strategy, lora)
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    optimizers = [torch.optim.AdamW(trained(m), lr=1e-2) for m in (whole, laid)]
    for step in range(5):
        batch = collate(feedback(step) if stage == "kto" else pairs(step), pad_id=0)
        want, got = want_step(batch, "cpu"), got_step(batch, "cpu")
        want.loss.backward()
        got.loss.backward()
        hp.reduce_gradients(laid)
        where = f"rank {rank} {stage}{' lora' if lora else ''} {strategy.mesh_axes} step {step}"
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0, msg=where)
        if step == 0:
            for (name, p), r in zip(laid.named_parameters(), whole.parameters()):
                assert (p.grad is None) == (r.grad is None), f"{where}: {name}"
                if p.grad is not None:
                    torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7,
                                               msg=f"{where}: {name}")
        for o in optimizers:
            o.step()
            o.zero_grad()


def main() -> None:
    rank = int(os.environ["RANK"])
    for stage, lora, strategy in CHECKS:
        check(stage, lora, strategy, rank)
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()

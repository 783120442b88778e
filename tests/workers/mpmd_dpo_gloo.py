"""Worker for test_mpmd_programs.py: DPO with its frozen reference a program of its own running ahead
(hp.mpmd's level 3, `hp.mpmd.policy_and_reference`) on two gloo ranks, against the plain DPO step.

A tiny Llama policy and its reference (the same weights, frozen) are each cut into two pipeline stages,
one per rank; a micro-batch is one (chosen, rejected) pair. The reference's forward runs a batch ahead
(its first stage two when staggered), planned into the policy's gaps, and its log-probabilities reach the
policy's last stage a step later. The placed step (`hp.mpmd.Placed`) plans again from its measured costs
after two steps. Over four steps with SGD between them, each step's loss and every gradient equal the
plain step's (fp32, relative 1e-5), staggered or not. Every check raises on failure.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hp.models import plan_for, tiny_config
from hp.mpmd.placed import Placed
from hp.mpmd.reference import dpo_loss, policy_and_reference, sequence_logps

MICRO, BETA, PROMPT, STEPS = 4, 0.1, 6, 4


def batch(step: int) -> dict:
    """MICRO pairs of 12-token sequences, the prompt's labels -100."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (MICRO, 2, 12), generator=g)
    labels = ids.clone()
    labels[..., :PROMPT] = -100
    return {"input_ids": ids, "labels": labels}


def plain_step(policy, reference, data: dict) -> torch.Tensor:
    loss = dpo_loss(BETA, MICRO)
    total = torch.zeros(())
    for m in range(MICRO):
        ids, labels = data["input_ids"][m], data["labels"][m]
        with torch.no_grad():
            ref = sequence_logps(reference(input_ids=ids).logits, labels)
        total = total + loss(sequence_logps(policy(input_ids=ids).logits, labels), ref, labels)
    total.backward()
    return total.detach()


def check(stagger: bool) -> None:
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
    reference = copy.deepcopy(policy).requires_grad_(False)
    want_policy = copy.deepcopy(policy)
    programs = policy_and_reference(policy, plan_for(policy.config), policy_ranks=(0, 1), microbatches=MICRO,
                                    loss=dpo_loss(BETA, MICRO), stagger=stagger, rank=dist.get_rank())
    step = Placed(programs, warmup=2)
    optimizer = torch.optim.SGD(step.parameters(), lr=0.5)
    want_optimizer = torch.optim.SGD(want_policy.parameters(), lr=0.5)
    ahead = programs.graph.furthest_ahead
    for n in range(STEPS):
        want = plain_step(want_policy, reference, batch(n))
        got = step(batch(n), *[batch(k) for k in range(n + 1, min(n + 1 + ahead, STEPS))])  # none past the end
        assert torch.allclose(got, want, rtol=1e-5), (stagger, n, got, want)
        grads = dict(want_policy.named_parameters())
        for (program, _), module in programs.modules.items():
            if program == "policy":
                for name, p in module.named_parameters():
                    assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), (stagger, n, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)


def main() -> None:
    dist.init_process_group("gloo")
    for stagger in (False, True):
        check(stagger)
        print(f"dpo with its reference ahead (staggered: {stagger}) follows the plain step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

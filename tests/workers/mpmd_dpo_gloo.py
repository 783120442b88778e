"""Worker for test_mpmd_programs.py: DPO with its frozen reference a program of its own running ahead
(hp.mpmd's level 3, `hp.mpmd.policy_and_reference`) on two gloo ranks, against the plain DPO step.

A tiny Llama policy and its reference (the same weights, frozen) are each cut into two pipeline stages,
one per rank; a micro-batch is one (chosen, rejected) pair. The reference's forward runs a batch ahead
(its first stage two when staggered), planned into the policy's gaps, and its log-probabilities reach the
policy's last stage a step later. The placed step (`hp.mpmd.Placed`) plans again from its measured costs
after two steps. Over four steps with SGD between them, each step's loss and every gradient equal the
plain step's (fp32, relative 1e-5), staggered or not. KTO likewise (`reference_point`): a micro-batch is
an answer and its mismatched pair, the policy's forward of the pairs without gradient a third program
whose terms each group of two micro-batches (a batch) gathers at the policy's last stage for its
reference point; the reference (other weights, so that the points are above 0) on the ranks in the other
order. Every check raises on failure.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from hp.models import plan_for, tiny_config
from transformers import AutoModelForCausalLM

from hp.mpmd.layout import sequence_logps
from hp.mpmd.placed import Placed
from hp.mpmd.reference import dpo_loss, kto_loss, policy_and_reference
from hp.train.config import Preference
from hp.train.preference import kto

MICRO, BETA, PROMPT, STEPS = 4, 0.1, 6, 4
GROUP = 2  # KTO: micro-batches per batch, whose mismatched pairs make one reference point


def batch(step: int) -> dict:
    """MICRO pairs of 12-token sequences, the prompt's labels -100."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (MICRO, 2, 12), generator=g)
    labels = ids.clone()
    labels[..., :PROMPT] = -100
    return {"input_ids": ids, "labels": labels, "desirable": torch.tensor([True, False, True, True])}


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


def plain_kto_step(policy, reference, data: dict) -> torch.Tensor:
    """Each batch of GROUP answers against its own reference point, as `hp.train.objectives.Kto` computes it."""
    total = torch.zeros(())
    for first in range(0, MICRO, GROUP):
        ids, labels = data["input_ids"][first:first + GROUP], data["labels"][first:first + GROUP]
        answers = sequence_logps(policy(input_ids=ids[:, 0]).logits, labels[:, 0])
        with torch.no_grad():
            pairs = sequence_logps(policy(input_ids=ids[:, 1]).logits, labels[:, 1])
            ref = [sequence_logps(reference(input_ids=ids[:, row]).logits, labels[:, row]) for row in (0, 1)]
        judged = kto(answers, ref[0], pairs, ref[1], data["desirable"][first:first + GROUP], Preference(beta=BETA))
        total = total + judged.losses.sum() / MICRO
    total.backward()
    return total.detach()


def check(stagger: bool, point: int = 0) -> None:
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
    reference = copy.deepcopy(policy).requires_grad_(False)
    if point:  # other weights: reference points above 0, so that the gathered terms count
        torch.manual_seed(1)
        reference = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2)).requires_grad_(False)
    want_policy = copy.deepcopy(policy)
    loss, plain = (kto_loss(BETA, MICRO), plain_kto_step) if point else (dpo_loss(BETA, MICRO), plain_step)
    programs = policy_and_reference(policy, plan_for(policy.config), policy_ranks=(0, 1), microbatches=MICRO,
                                    loss=loss, stagger=stagger, rank=dist.get_rank(), reference_point=point,
                                    reference=copy.deepcopy(reference), reference_ranks=(1, 0) if point else None)
    step = Placed(programs, warmup=2)
    optimizer = torch.optim.SGD(step.parameters(), lr=0.5)
    want_optimizer = torch.optim.SGD(want_policy.parameters(), lr=0.5)
    ahead = programs.graph.furthest_ahead
    for n in range(STEPS):
        want = plain(want_policy, reference, batch(n))
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
    check(True, point=GROUP)
    print("kto with its reference ahead and its reference point gathered follows the plain step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for test_mpmd_programs.py: DPO with its frozen reference run a batch ahead (hp.mpmd's level 3) on two
gloo ranks, against the plain DPO step.

A tiny Llama policy and its reference (the same weights, frozen) are each cut into two pipeline stages by
`hp.parallel.pipeline.cut`, one per rank; a micro-batch is one (chosen, rejected) pair. The reference's
forward of the next batch runs in this step, planned into the policy's gaps, and its log-probabilities
reach the policy's last stage a step later. Over three steps with SGD between them, each step's loss and
every gradient equal the plain step's (fp32, relative 1e-5). Every check raises on failure.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hp.models import plan_for, tiny_config
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Flow, Graph, Program
from hp.mpmd.runtime import Runtime, step_loss
from hp.mpmd.schedule import schedule
from hp.parallel.pipeline import cut
from hp.parallel.pipeline_split import StageSplit

MICRO, BETA, PROMPT = 4, 0.1, 6


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MICRO pairs of 12-token sequences (ids, labels), the prompt's labels -100."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (MICRO, 2, 12), generator=g)
    labels = ids.clone()
    labels[..., :PROMPT] = -100
    return ids, labels


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its supervised tokens."""
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    margin = (policy[0] - reference[0]) - (policy[1] - reference[1])
    return -torch.nn.functional.logsigmoid(BETA * margin) / MICRO


def plain_step(policy, reference, data) -> torch.Tensor:
    ids, labels = data
    total = torch.zeros(())
    for m in range(MICRO):
        with torch.no_grad():
            ref = sequence_logps(reference(input_ids=ids[m]).logits, labels[m])
        total = total + dpo_loss(sequence_logps(policy(input_ids=ids[m]).logits, labels[m]), ref)
    total.backward()
    return total.detach()


def stage_fns(stages: dict) -> dict:
    def first(model):
        return lambda data, m, inputs: model(input_ids=data[0][m], use_cache=False).logits  # the stream
    return {
        ("policy", 0): first(stages["policy", 0]),
        ("reference", 0): first(stages["reference", 0]),
        ("policy", 1): lambda data, m, inputs: dpo_loss(
            sequence_logps(stages["policy", 1](inputs_embeds=inputs[0], use_cache=False).logits, data[1][m]), inputs[1]),
        ("reference", 1): lambda data, m, inputs: sequence_logps(
            stages["reference", 1](inputs_embeds=inputs[0], use_cache=False).logits, data[1][m]),
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = tiny_config("llama", layers=2)
    policy = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(policy).requires_grad_(False)
    want_policy = copy.deepcopy(policy)
    split = StageSplit.of_counts((1, 1))
    stages = {(name, s): cut(copy.deepcopy(model), plan_for(config), split, s)
              for name, model in (("policy", policy), ("reference", reference)) for s in (0, 1)}
    graph = Graph((Program("policy", (0, 1)), Program("reference", (0, 1), trains=False, ahead=1)),
                  (Flow(("reference", 1), ("policy", 1)),), MICRO)
    runtime = Runtime(schedule(graph, Costs.unit(graph)), stage_fns(stages))
    mine = stages["policy", rank]
    optimizer, want_optimizer = torch.optim.SGD(mine.parameters(), lr=0.5), torch.optim.SGD(want_policy.parameters(), lr=0.5)
    for step in range(3):
        want = plain_step(want_policy, reference, batch(step))
        losses = runtime.step(batch(step), batch(step + 1) if step < 2 else None)  # the last step: none ahead
        got = step_loss(losses)
        assert torch.allclose(got, want, rtol=1e-5), (step, got, want)
        grads = dict(want_policy.named_parameters())
        for name, p in mine.named_parameters():
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), (step, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    print("dpo with its reference a batch ahead follows the plain step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

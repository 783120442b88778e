"""Worker for test_mpmd_programs.py: a policy and its frozen reference placed with tensor parallel inside their
stages (`hp.mpmd.Placed(planes=2)`), on 2 or 4 gloo ranks, against the plain step of unsharded models.

The ranks are two tensor parallel planes of the placement (graph rank r of plane j is global rank 2r + j).
On 2 ranks the policy and its reference are one stage each, both on graph rank 0, laid out over its two
ranks; on 4 the policy is cut into two stages (graph ranks 0, 1) and the reference into two on the ranks
in the other order, each stage laid out over its graph rank's two ranks, each plane sending its own block
of the stream to its counterpart. DPO (staggered, a batch ahead) and KTO (its reference points gathered),
sequence parallel on 4 ranks: over three SGD steps (the last planned from the measured costs) each step's
loss and every gradient (whole) equal the plain step's (fp32, relative 1e-5). Every check raises on failure.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from hp.models import plan_for, tiny_config
from mpmd_dpo_gloo import (  # the batches and the plain steps of the unsharded models
    BETA,
    GROUP,
    MICRO,
    batch,
    plain_kto_step,
)
from mpmd_dpo_gloo import plain_step as plain_dpo_step
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hp
from hp.mpmd.grid import replica_of
from hp.mpmd.placed import Placed
from hp.mpmd.reference import dpo_loss, kto_loss, policy_and_reference

STEPS = 3


def plain_step(policy, reference, data: dict, point: int) -> torch.Tensor:
    """DPO's pairs, or KTO's answers in batches of GROUP against their own reference points."""
    return (plain_kto_step if point else plain_dpo_step)(policy, reference, data)


def check(stages: int, point: int) -> None:
    strategy = hp.Strategy(tp=2, sp=stages == 2)
    mesh = hp.mesh(pp=stages, tp=2) if stages > 1 else hp.mesh(tp=2)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
    torch.manual_seed(1)  # other weights: KTO's reference points above 0
    reference = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2)).requires_grad_(False)
    want_policy, want_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    ranks = tuple(range(stages))
    loss = kto_loss(BETA, MICRO) if point else dpo_loss(BETA, MICRO)
    programs = policy_and_reference(policy, plan_for(policy.config), policy_ranks=ranks,
                                    reference_ranks=ranks[::-1], microbatches=MICRO, loss=loss, reference=reference,
                                    rank=replica_of(1, planes=2)[1], reference_point=point, strategy=strategy,
                                    mesh=mesh["tp"])
    step = Placed(programs, warmup=2, planes=2)
    optimizer = torch.optim.SGD(step.parameters(), lr=0.5)
    want_optimizer = torch.optim.SGD(want_policy.parameters(), lr=0.5)
    ahead = programs.graph.furthest_ahead
    for n in range(STEPS):
        want = plain_step(want_policy, want_reference, batch(n), point)
        got = step(batch(n), *[batch(k) for k in range(n + 1, n + 1 + ahead)])
        assert torch.allclose(got, want, rtol=1e-5), (stages, point, n, got, want)
        grads = dict(want_policy.named_parameters())
        for (program, _), module in programs.modules.items():
            if program == "policy":
                for name, p in module.named_parameters():
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    assert torch.allclose(grad, grads[name].grad, rtol=1e-5, atol=1e-6), (stages, point, n, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)


def main() -> None:
    dist.init_process_group("gloo")
    stages = dist.get_world_size() // 2
    for point in (0, GROUP):
        check(stages, point)
        print(f"{'kto' if point else 'dpo'} with tp inside {stages} stage(s) follows the plain step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for test_mpmd_programs.py: a Qwen2.5-VL's vision tower placed on a sub-mesh by
`hp.mpmd(model, place=..., mesh=...)` (level 2) on two gloo ranks, against HF's plain step.

Four placements: the tower spread over the pipeline's own two ranks (in its bubbles, held whole on both,
its gradients summed over them; the language model's backward split into input and weight gradients), the tower on rank 1 alone beside a one-stage language model on rank 0,
a frozen tower spread over both ranks, run a batch ahead, and the tower and a one-stage language model on
one graph rank laid out tp=2 with sequence parallel over the two ranks (`strategy=`: two planes); a trained tower's second step runs twice
before the optimizer steps, its gradients accumulating as autograd's do. A micro-batch is one sample and its images (one or two). Each step's loss and every gradient, the
tower's included, equal the unsharded model's (fp32, relative 1e-5), over three SGD steps: two in unit
time's plan, then the plan made from the measured costs. Every check raises.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from hp.models import plan_for, tiny_config, tiny_vl_batch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForImageTextToText

import hp

IMAGES = [[(16, 16)], [(16, 8), (8, 8)], [(8, 24)], [(16, 16)]]  # a sample's images: a sample is a micro-batch
PLACEMENTS = {"in the pipeline's bubbles, the backward split": ({"enc": (0, 1), "pp": (0, 1)}, True, None),
              "on a rank of its own": ({"enc": (1,), "pp": (0,)}, True, None),
              "frozen, a batch ahead in the pipeline's bubbles": ({"enc": (0, 1), "pp": (0, 1)}, False, None),
              "laid out tp=2 beside its language model": ({"enc": (0,), "pp": (0,)}, True,
                                                          hp.Strategy(tp=2, sp=True))}
STEPS = 3


def check(name: str, mesh: dict, tower_trains: bool, strategy) -> None:
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", layers=2)
    reference = AutoModelForImageTextToText.from_config(config)
    reference.model.visual.requires_grad_(tower_trains)
    full = [tiny_vl_batch(reference, images=IMAGES, seq=24, seed=n) for n in range(STEPS)]
    batches = [{k: v for k, v in b.items() if k != "position_ids"} for b in full]  # the placed step computes them
    step = hp.mpmd(copy.deepcopy(reference), place={"model.visual": "enc"}, mesh=mesh, plan=plan_for(config),
                   microbatches=len(IMAGES), warmup=2, strategy=strategy, zero_bubble="split" in name)
    optimizer = torch.optim.SGD(step.parameters(), lr=0.5)
    want_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    for n in range(STEPS):
        for _ in range(2 if tower_trains and n == 1 else 1):  # gradients accumulate over calls, as autograd's
            want = reference(**full[n]).loss
            want.backward()
            got = step(batches[n], *batches[n + 1:n + 2])  # a frozen tower runs a batch ahead
            assert torch.allclose(got, want.detach(), rtol=1e-5), (n, got, want)
        grads = dict(reference.named_parameters())
        for (program, _), module in step.programs.modules.items():
            prefix = "model.visual." if program == "vision" else ""
            for name, p in module.named_parameters():
                if p.requires_grad:
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    assert torch.allclose(grad, grads[prefix + name].grad, rtol=1e-5, atol=1e-7), (n, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert step.costs is not None and step.simulation().step_seconds > 0  # planned from what it measured


def main() -> None:
    dist.init_process_group("gloo")
    for name, (mesh, tower_trains, strategy) in PLACEMENTS.items():
        check(name, mesh, tower_trains, strategy)
        print(f"a vision tower {name} follows HF's step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

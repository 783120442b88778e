"""Worker for test_mpmd_programs.py: a Qwen2.5-VL's vision tower as a program of its own spread over two gloo
ranks (hp.mpmd's level 2, `hp.mpmd.programs.vision_language`), its language model cut into two pipeline
stages, against HF's plain step.

A micro-batch is one sample and its images (one or two). The tower runs each micro-batch on the rank the
plan gives it (held whole on both, its gradients summed over them). Over two SGD steps the loss and every
gradient, the tower's included, equal the unsharded model's (fp32, relative 1e-5). Every check raises.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from hp.models import plan_for, tiny_config, tiny_vl_batch
from hp.mpmd.costs import Costs
from hp.mpmd.programs import vision_language
from hp.mpmd.runtime import Runtime, step_loss
from hp.mpmd.schedule import schedule

IMAGES = [[(16, 16)], [(16, 8), (8, 8)], [(8, 24)], [(16, 16)]]  # a sample's images: a sample is a micro-batch


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", layers=2)
    reference = AutoModelForImageTextToText.from_config(config)
    batch = tiny_vl_batch(reference, images=IMAGES, seq=24)
    programs = vision_language(copy.deepcopy(reference), plan_for(config), tower_ranks=(0, 1), stage_ranks=(0, 1),
                               microbatches=len(IMAGES))
    share = {"vision": 0.5, "language": 1.0}  # the tower's work half a language stage's
    costs = Costs({(k, n): share[n[0]] * {"F": 1.0, "B": 2.0}[k] for n in programs.graph.nodes() for k in "FB"})
    plan = schedule(programs.graph, costs)
    assert {r for action, r in plan.where.items() if action.program == "vision"} == {0, 1}, plan
    runtime = Runtime(plan, programs.stages)
    tower, stage = programs.modules["vision", 0], programs.modules["language", rank]
    optimizer = torch.optim.SGD([*tower.parameters(), *stage.parameters()], lr=0.5)
    want_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        want = reference(**batch).loss
        want.backward()
        losses = runtime.step(batch)
        got = step_loss(losses)
        assert torch.allclose(got, want.detach(), rtol=1e-5), (step, got, want)
        grads = dict(reference.named_parameters())
        for p in tower.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad)  # each rank holds the gradients of the micro-batches it ran
        for name, p in tower.named_parameters():
            assert torch.allclose(p.grad, grads[f"model.visual.{name}"].grad, rtol=1e-5, atol=1e-7), (step, name)
        for name, p in stage.named_parameters():
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), (step, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    print("a vision tower spread over the ranks follows HF's step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for test_mpmd_programs.py: a Qwen2.5-VL's vision tower as a program of its own spread over two gloo
ranks (hp.mpmd's level 2), its language model cut into two pipeline stages, against HF's plain step.

A micro-batch is one sample and its image. The tower runs each micro-batch on the rank the plan gives it
(held whole on both, its gradients summed over them); the first language stage embeds the tokens, puts
the tower's features in the image tokens' places and runs its block with the M-RoPE positions computed
once for the batch, as HF does; the second runs its block, the norm, the head and the loss (each
micro-batch's summed token losses over the whole batch's supervised tokens). Over two SGD steps the
loss and every gradient, the tower's included, equal the unsharded model's (fp32, relative 1e-5).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from hp.models import plan_for, tiny_config, tiny_vl_batch
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Flow, Graph, Program
from hp.mpmd.runtime import Runtime
from hp.mpmd.schedule import schedule
from hp.parallel.pipeline import Skipped, cut
from hp.parallel.pipeline_split import StageSplit

IMAGES = [[(16, 16)], [(16, 8)], [(8, 24)], [(16, 16)]]  # one image a sample: a sample is a micro-batch


def micro(batch: dict, m: int) -> dict:
    """Sample m: its ids, labels and positions, and its image's patches and grid."""
    grids = batch["image_grid_thw"]
    sizes = grids.prod(-1).tolist()
    start = sum(sizes[:m])
    return {"ids": batch["input_ids"][m:m + 1], "labels": batch["labels"][m:m + 1],
            "positions": batch["position_ids"][:, m:m + 1], "pixels": batch["pixel_values"][start:start + sizes[m]],
            "grid": grids[m:m + 1]}


def stage_fns(tower, first, last, image_token: int, supervised: int) -> dict:
    def vision(batch, m, inputs):
        x = micro(batch, m)
        return tower(x["pixels"], grid_thw=x["grid"]).pooler_output

    def language_first(batch, m, inputs):
        x = micro(batch, m)
        embeds = first.get_input_embeddings()(x["ids"])
        places = (x["ids"] == image_token).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(places, inputs[0].to(embeds.dtype))
        return first(inputs_embeds=embeds, position_ids=x["positions"], use_cache=False).logits  # the stream

    def language_last(batch, m, inputs):
        x = micro(batch, m)
        logits = last(inputs_embeds=inputs[0], position_ids=x["positions"], use_cache=False).logits
        targets = x["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                                   ignore_index=-100, reduction="sum")
        return losses / supervised

    return {("vision", 0): vision, ("language", 0): language_first, ("language", 1): language_last}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", layers=2)
    reference = AutoModelForImageTextToText.from_config(config)
    batch = tiny_vl_batch(reference, images=IMAGES, seq=24)
    model = copy.deepcopy(reference)
    split, plan = StageSplit.of_counts((1, 1)), plan_for(config)
    first, last = (cut(copy.deepcopy(model), plan, split, s) for s in (0, 1))
    for stage in (first, last):
        stage.model.visual = Skipped()  # the tower is a program of its own
    graph = Graph((Program("vision", (0, 1), spread=True), Program("language", (0, 1))),
                  (Flow(("vision", 0), ("language", 0)),), len(IMAGES))
    share = {"vision": 0.5, "language": 1.0}  # the tower's work half a language stage's
    costs = Costs({(k, n): share[n[0]] * {"F": 1.0, "B": 2.0}[k] for n in graph.nodes() for k in "FB"})
    plan = schedule(graph, costs)
    assert {rank for action, rank in plan.where.items() if action.program == "vision"} == {0, 1}, plan
    runtime = Runtime(plan, stage_fns(model.model.visual, first, last, config.image_token_id,
                                      int((batch["labels"][:, 1:] != -100).sum())))
    mine = [model.model.visual, first if rank == 0 else last]
    params = [p for module in mine for p in module.parameters()]
    optimizer, want_optimizer = torch.optim.SGD(params, lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        want = reference(**batch).loss
        want.backward()
        losses = runtime.step(batch)
        got = torch.stack(list(losses.values())).sum() if losses else torch.zeros(())
        dist.all_reduce(got)
        assert torch.allclose(got, want.detach(), rtol=1e-5), (step, got, want)
        grads = dict(reference.named_parameters())
        for p in model.model.visual.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)  # each rank holds the gradients of the micro-batches it ran
        for name, p in model.model.visual.named_parameters():
            assert torch.allclose(p.grad, grads[f"model.visual.{name}"].grad, rtol=1e-5, atol=1e-7), (step, name)
        for name, p in mine[1].named_parameters():
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), (step, name)
        for opt in (optimizer, want_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    print("a vision tower spread over the ranks follows HF's step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A model's sub-models as programs: a vision-language model's tower beside its language model's stages.

Level 2 runs the vision tower and the language model of one model as
programs of their own. `vision_language` cuts a Qwen-VL-style model (its
family's `hp.ModelPlan` names the tower, the blocks, the embedding, the
norm and the head) into:

- **the tower**, one program whose micro-batches each run on one of
  `tower_ranks` (held whole on each, its gradients summed over them as
  data parallel's: `spread`). A frozen tower (LlamaFactory's default for a
  pretrained one) has no backward and depends on nothing of the step, so it
  runs a batch ahead: its features for batch t + 1 are computed in step t,
  wherever a rank is idle;
- **the language model**, cut into pipeline stages by `split`
  (`hp.parallel.pipeline.cut`: each stage is the model itself with what
  other stages hold skipped, so parameter names stay the model's own),
  stage i on `stage_ranks[i]`. The first embeds the tokens and puts the
  tower's features in the image tokens' places; every stage runs its
  blocks with the M-RoPE positions the batch carries; the last runs the
  norm, the head and the loss: each micro-batch's summed token losses over
  the whole batch's supervised tokens, so the micro-batches' losses add up
  to HF's mean.

A micro-batch is one sample. The batch is a dict as HF's processor makes
it (`input_ids`, `labels`, `pixel_values`, `image_grid_thw`);
`Programs.prepare` adds the M-RoPE `position_ids` from the model's own
`get_rope_index` on the whole batch when they are missing. A sample holds
images (no video) or none, each image opened by the vision-start token,
which is how a sample's images are found. Given `rank`, the model
itself is cut to what that rank runs, as `hp.parallel.pipeline` cuts a
stage (its parameter names stay the model's own).

>>> import torch
>>> from transformers import AutoModelForImageTextToText
>>> from hp.models import plan_for, tiny_config
>>> model = AutoModelForImageTextToText.from_config(tiny_config("qwen2_5_vl", layers=2))
>>> programs = vision_language(model, plan_for(model.config), tower_ranks=(0, 1), stage_ranks=(0, 1), microbatches=4)
>>> [p.name for p in programs.graph.programs], sorted(programs.stages)
(['vision', 'language'], [('language', 0), ('language', 1), ('vision', 0)])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp.mpmd.graph import Flow, Graph, Node, Program
from hp.mpmd.layout import Layout, local, sequence_logps
from hp.ops.region import region
from hp.parallel.apply import apply_strategy
from hp.parallel.model_plan import ModelPlan
from hp.parallel.pipeline import Skipped, cut
from hp.parallel.pipeline_split import StageSplit
from hp.parallel.sequence import IGNORE_INDEX
from hp.parallel.strategy import Strategy
from hp.parallel.ties import ties_head


@dataclass
class Programs:
    """A graph of programs, the function each stage runs (`hp.mpmd.Runtime`'s `stages`), the module
    whose parameters each stage trains, and what completes a batch before its step (`prepare`)."""

    graph: Graph
    stages: dict[Node, Callable]
    modules: dict[Node, nn.Module]
    prepare: Callable[[Any], Any] = lambda batch: batch
    # (program, embedding weight, head weight) where that program's stages hold a head tied to its embedding:
    # its first stage one copy, its last the other (`hp.parallel.ties.ties_head`)
    tied: tuple[str, str, str] | None = None


def vision_language(model: nn.Module, plan: ModelPlan, *, tower_ranks: tuple[int, ...],
                    stage_ranks: tuple[int, ...], microbatches: int, split: tuple[int, ...] | None = None,
                    rank: int | None = None, strategy: Strategy | None = None, mesh=None,
                    zero_bubble: bool = False) -> Programs:
    """`model`'s tower and language model as programs (see the module); `split`: blocks per stage (even
    by default); `rank`: `model` cut in place to what that rank runs (None: every stage a copy, the tower
    shared: one process holding all); `strategy` (tp, sp, vision_tp) and `mesh`, with `rank`: what the rank
    holds laid out by it on `mesh` (`hp.mpmd.Placed(planes=tp)`'s tensor parallel group), its tensors
    crossing as each rank's own block; `zero_bubble`: the language model's stages split their backward
    (`Program.split`)."""
    blocks = len(model.get_submodule(plan.blocks))
    counts = split or even_split(blocks, len(stage_ranks))
    cuts = StageSplit.of_counts(counts)
    trains = any(p.requires_grad for p in model.get_submodule(plan.vision).parameters())
    graph = tower_graph(tower_ranks, stage_ranks, microbatches, trains, zero_bubble)
    tokens = (model.config.image_token_id, model.config.vision_start_token_id)
    width = model.get_input_embeddings().embedding_dim  # the tower's features are in the embedding's space
    prepare = with_positions(model)
    tied = tied_stages(model, plan, "language")
    if rank is not None:
        layout = Layout(strategy, mesh) if strategy is not None else None
        return Programs(graph, *_this_ranks_part(model, plan, cuts, graph, rank, tokens, width, layout), prepare,
                        tied)
    fns: dict[Node, Callable] = {("vision", 0): _tower(model.get_submodule(plan.vision), tokens, width)}
    modules: dict[Node, nn.Module] = {("vision", 0): model.get_submodule(plan.vision)}
    for s in range(len(stage_ranks)):
        stage = modules["language", s] = cut(copy.deepcopy(model), plan, cuts, s)
        stage.set_submodule(plan.vision, Skipped())  # the tower is a program of its own
        fns["language", s] = _language(stage, s == 0, s == len(stage_ranks) - 1, tokens)
    return Programs(graph, fns, modules, prepare, tied)


def tied_stages(model: nn.Module, plan: ModelPlan, program: str) -> tuple[str, str, str] | None:
    """`Programs.tied` for `program`, the stages of `model` (before it is cut): None when its head is its own."""
    if not ties_head(model, plan):
        return None
    return program, f"{plan.embedding}.weight", f"{plan.head}.weight"


def tower_graph(tower_ranks: tuple[int, ...], stage_ranks: tuple[int, ...], microbatches: int,
                trains: bool = True, zero_bubble: bool = False) -> Graph:
    """A tower spread over `tower_ranks` (a batch ahead when frozen) feeding the first of the language
    model's stages on `stage_ranks` (their backward split with `zero_bubble`).

    >>> [p.ahead for p in tower_graph((2,), (0, 1), 4, trains=False).programs]
    [1, 0]
    """
    tower = Program("vision", tuple(tower_ranks), spread=True, trains=trains, ahead=0 if trains else 1)
    language = Program("language", tuple(stage_ranks), split=zero_bubble)
    return Graph((tower, language), (Flow(("vision", 0), ("language", 0)),), microbatches)


def _this_ranks_part(model: nn.Module, plan: ModelPlan, cuts: StageSplit, graph: Graph, rank: int,
                     tokens: tuple[int, int], width: int, layout: Layout | None) -> tuple[dict, dict]:
    """`model` cut in place to what `rank` runs: its language stage (if any) and the tower (if it runs it),
    laid out by `layout` when given. Its parameter names stay the model's own, so its state dict is this rank's
    share of a checkpoint."""
    stage_ranks, tower_ranks = graph.program["language"].ranks, graph.program["vision"].ranks
    mine = [s for s, on in enumerate(stage_ranks) if on == rank]
    if len(mine) > 1:
        raise ValueError(f"rank {rank} holds stages {mine}: a model cut in place holds one stage per rank")
    fns: dict[Node, Callable] = {}
    modules: dict[Node, nn.Module] = {}
    if rank in tower_ranks:
        modules["vision", 0] = model.get_submodule(plan.vision)
    else:
        model.set_submodule(plan.vision, Skipped())
    cut(model, plan, cuts, mine[0] if mine else None)  # the tower's rank alone keeps none of the language model
    if layout is not None:
        apply_strategy(model, layout.mesh, layout.strategy, plan)
    if ("vision", 0) in modules:
        fns["vision", 0] = _tower(modules["vision", 0], tokens, width)
    if mine:
        modules["language", mine[0]] = model
        fns["language", mine[0]] = _language(model, mine[0] == 0, mine[0] == len(stage_ranks) - 1, tokens, layout)
    return fns, modules


def with_positions(model: nn.Module) -> Callable[[dict], dict]:
    """The batch with its M-RoPE positions (the model's own `get_rope_index` on the whole batch) when missing."""
    def prepare(batch: dict) -> dict:
        if "position_ids" in batch:
            return batch
        ids = batch["input_ids"]
        types = batch.get("mm_token_type_ids")
        types = (ids == model.config.image_token_id).int() if types is None else types
        positions, _ = model.model.get_rope_index(ids, image_grid_thw=batch.get("image_grid_thw"),
                                                  mm_token_type_ids=types)
        return {**batch, "position_ids": positions}
    return prepare


def even_split(blocks: int, stages: int) -> tuple[int, ...]:
    """`blocks` over `stages`, the earlier stages taking the remainder.

    >>> even_split(7, 3)
    (3, 2, 2)
    """
    return tuple(blocks // stages + (s < blocks % stages) for s in range(stages))


def sample(batch: dict, m: int, vision_start: int) -> dict:
    """Sample m of `batch`: its ids, labels and positions, its images' patches and grids (none: a sample
    without images), and what its summed token loss is divided by: the batch's `supervised[m]` when
    given (accumulated batches, each its own mean), else the batch's supervised token count."""
    ids, grids = batch["input_ids"], batch.get("image_grid_thw")
    images = (ids == vision_start).sum(-1).tolist()  # each image opens with the vision-start token
    first = sum(images[:m])
    sizes = grids.prod(-1).tolist() if grids is not None else []
    start, count = sum(sizes[:first]), sum(sizes[first:first + images[m]])
    pixels = batch.get("pixel_values")
    supervised = batch.get("supervised")  # each sample's divisor, when the batch gives them
    return {"ids": ids[m:m + 1], "labels": batch["labels"][m:m + 1], "positions": batch["position_ids"][:, m:m + 1],
            "pixels": pixels[start:start + count] if pixels is not None else None,
            "grid": grids[first:first + images[m]] if grids is not None else ids.new_zeros(0, 3),
            "supervised": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) if supervised is None else supervised[m]}


def _tower(tower: nn.Module, tokens: tuple[int, int], width: int) -> Callable:
    def run(batch: dict, m: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        x = sample(batch, m, tokens[1])
        if len(x["grid"]) == 0:  # a sample without images: no features, but a backward to run
            anchor = next(tower.parameters())
            return local(anchor).new_zeros(0, width) + 0 * local(anchor).sum()
        return local(tower(x["pixels"], grid_thw=x["grid"]).pooler_output)  # one feature per image token
    return run


def _language(stage: nn.Module, first: bool, last: bool, tokens: tuple[int, int],
              layout: Layout | None = None) -> Callable:
    def run(batch: dict, m: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        x = sample(batch, m, tokens[1])
        if first:  # laid out, the embedding and the features' scatter run as in HF's forward, under hp's rules
            with region() if layout is not None else nullcontext():
                embeds = stage.get_input_embeddings()(x["ids"])
                places = (x["ids"] == tokens[0]).unsqueeze(-1).expand(*x["ids"].shape, embeds.shape[-1])
                stream = embeds.masked_scatter(places, inputs[0].to(embeds.dtype))
        else:
            stream = inputs[0] if layout is None else layout.stream(inputs[0])
        out = stage(inputs_embeds=stream, position_ids=x["positions"], use_cache=False).logits
        if not last:
            return local(out)  # the norm and the head are skipped: the residual stream
        return -sequence_logps(out, x["labels"], layout).sum() / x["supervised"]
    return run

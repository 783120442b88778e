"""`hp train` under `parallel.mpmd.place`: a model's sub-models as programs of their own, one step over the ranks.

Two placements (`hp.parallel.placement`):

- `vision` (`hp.mpmd`'s level 2, `hp.mpmd.placed`): a vision-language
  model's language model is cut into `pp` pipeline stages, one per rank,
  and its vision tower runs as a program of its own, spread over the
  pipeline's ranks (`vision: pp`, in its bubbles) or on ranks of its own
  (`vision: N`). A step is one placed step over the accumulated batches:
  each sample is a micro-batch, and each sample's token loss is divided by
  its own batch's supervised tokens times the accumulation steps, which is
  `hp train`'s mean of per-batch means. A frozen tower (LlamaFactory's
  default) runs a batch ahead.
- `reference` (level 3, `hp.train.placed_reference`): DPO's or KTO's
  policy and its frozen reference, the reference a batch ahead.

Each rank's model is cut in place to what it runs (parameter names stay the
model's own), and under `tp` laid out over its tensor parallel group (the
world is (pp + own ranks) x dp x tp: dp replicas of tp planes,
`hp.mpmd.grid`), so the optimizer, the checkpoints and their manifests see
this rank's share as under pp. A program running ahead reads the next
steps' batches by position, without moving the stream (a resumed run reads
them again). The first three steps are timed and the order of every rank's
work is planned again from them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp.models import plan_for
from hp.mpmd.choice import Choice, choose_tower, tower_costs
from hp.mpmd.grid import replica_of
from hp.mpmd.placed import Placed
from hp.mpmd.programs import vision_language
from hp.parallel.placement import AUTO
from hp.parallel.recompute import recompute_blocks
from hp.parallel.strategy import Strategy
from hp.train.config import TrainConfig
from hp.train.data import IGNORE_INDEX, Batch
from hp.train.loader import positions_from
from hp.train.objectives import Reference
from hp.train.placed_reference import (
    KtoLosses,
    PairLosses,
    feedback_batch,
    pairs_batch,
    policy_programs,
)
from hp.train.precision import autocast

WARMUP = 3  # steps timed before the order of work is planned from their costs


@dataclass
class PlacedRun:
    """The placed step, how a step's batches become its batch (`merge(parts, pad_id, device)`), and the
    rewards a step reports (a dpo or kto step's; a collective)."""

    step: Placed
    merge: Callable[[list[Batch], int, str], dict]
    rewards: Callable[[], dict[str, float]] = dict
    choice: Choice | None = None  # where `auto` placed the program, and why


def place(model: nn.Module, config: TrainConfig, reference: Reference | None = None, batches=None,
          pad_id: int = 0, mesh=None) -> PlacedRun:
    """`model` cut in place into this rank's part of the placed programs (in its data parallel replica: the
    world is dp blocks of (pp + own ranks) x tp, each stage laid out over tp ranks of `mesh`); `reference`: a
    dpo or kto stage's; `batches`: the stream, whose first step a tower placed `auto` is measured on."""
    strategy = config.parallel
    if strategy.recompute:
        recompute_blocks(model.get_submodule(plan_for(model.config).blocks))
    replica = Replica.of(strategy)
    with autocast(config.bf16, next(model.parameters()).device):  # what `auto` measures is what will run
        if strategy.mpmd_place.program == "reference":
            return _policy_and_reference(model, config, reference, replica, mesh)
        return _vision_language(model, config, replica, batches, pad_id, mesh)


def _policy_and_reference(model: nn.Module, config: TrainConfig, reference: Reference, replica: Replica,
                          mesh) -> PlacedRun:
    microbatches = config.per_device_train_batch_size * config.gradient_accumulation_steps  # a replica's pairs
    device = next(model.parameters()).device
    if config.stage == "kto":  # each batch's answers against its own reference point (no replicas)
        losses = KtoLosses(config.preference, config.per_device_train_batch_size, config.gradient_accumulation_steps,
                           device)
        merge = feedback_batch
    else:
        losses = PairLosses(config.preference, microbatches * config.parallel.dp, device)
        merge = functools.partial(pairs_batch, replica=replica.share)
    programs, choice = policy_programs(model, reference, config, losses, microbatches, replica.rank,
                                       _laid_out(config.parallel, mesh))
    step = Placed(programs, warmup=WARMUP, replicas=config.parallel.dp, planes=config.parallel.tp)
    return PlacedRun(step, merge, losses.metrics, choice)


def _vision_language(model: nn.Module, config: TrainConfig, replica: Replica, batches, pad_id: int,
                     mesh) -> PlacedRun:
    strategy, plan = config.parallel, plan_for(model.config)
    microbatches = config.per_device_train_batch_size * config.gradient_accumulation_steps  # a replica's samples
    choice, stage_ranks = None, tuple(range(strategy.pp))
    if strategy.mpmd_place.where == AUTO:  # measured on the whole model and the first step, before the cut
        first = _merged(_peek(batches, 0, config.gradient_accumulation_steps), pad_id,
                        str(next(model.parameters()).device))
        costs = tower_costs(model, plan, first, group=dist.group.WORLD)
        trains = any(p.requires_grad for p in model.get_submodule(plan.vision).parameters())
        choice = choose_tower(costs, world=strategy.pp, blocks=len(model.get_submodule(plan.blocks)),
                              microbatches=microbatches, trains=trains, zero_bubble=strategy.mpmd_zero_bubble)
        stage_ranks, tower_ranks = choice.ranks
    else:
        tower_ranks = strategy.mpmd_place.ranks(strategy.pp)
    programs = vision_language(model, plan, tower_ranks=tower_ranks, stage_ranks=stage_ranks,
                               split=strategy.pp_split, microbatches=microbatches, rank=replica.rank,
                               zero_bubble=strategy.mpmd_zero_bubble, **_laid_out(strategy, mesh))
    merge = functools.partial(_merged, replica=replica.share, vision_start=model.config.vision_start_token_id)
    return PlacedRun(Placed(programs, warmup=WARMUP, replicas=strategy.dp, planes=strategy.tp), merge, choice=choice)


def _laid_out(strategy: Strategy, mesh) -> dict:
    """How a rank's stages are laid out under tp (over its tensor parallel group), as programs take it."""
    return {"strategy": Strategy(tp=strategy.tp, sp=strategy.sp), "mesh": mesh["tp"]} if strategy.tp > 1 else {}


@dataclass(frozen=True)
class Replica:
    """This rank's place among dp replicas of the placed step: its rank within its replica, and its
    replica's share of each batch's rows (`share`: (index, count))."""

    rank: int
    share: tuple[int, int]

    @classmethod
    def of(cls, strategy: Strategy) -> Replica:
        index, rank = replica_of(strategy.dp, planes=strategy.tp)
        return cls(rank, (index, strategy.dp))


def placed_step(run: PlacedRun, batches, config: TrainConfig, pad_id: int, device: str) -> tuple[float, int, dict]:
    """One optimizer step's forward and backward over the accumulated batches; (loss, tokens, rewards)."""
    accumulate = config.gradient_accumulation_steps
    parts = [next(batches) for _ in range(accumulate)]
    upcoming = [run.merge(_peek(batches, accumulate * k, accumulate), pad_id, device)  # the next steps' batches
                for k in range(run.step.graph.furthest_ahead)]
    with autocast(config.bf16, device):
        loss = run.step(run.merge(parts, pad_id, device), *upcoming)
    tokens = sum(b.input_ids.numel() for batch in parts for b in (batch, batch.kl) if b is not None)  # as processed
    return float(loss), tokens, run.rewards()


def placed_evaluation(run: PlacedRun, pad_id: int, device: str) -> Callable[[Batch], torch.Tensor]:
    """A held-out batch's loss under the placement, forward only (`hp.mpmd.Placed.evaluate`: every replica
    evaluates the whole batch)."""
    return lambda batch: run.step.evaluate(_merged([batch], pad_id, device))


def placed_summary(run: PlacedRun) -> dict:
    """What the run summary says of a placed step: where each program ran, and its plan's replay with the
    measured costs (rank 0's, the same on every rank)."""
    step = run.step
    found = {"programs": {p.name: list(p.ranks) for p in step.graph.programs}, "replicas": step.replicas,
             "planned_from_costs": step.costs is not None}  # each replica's ranks, from its first
    if step.costs is not None:
        sim = step.simulation()
        found |= {"predicted_step_s": sim.step_seconds, "idle_share": [round(i, 4) for i in sim.idle_share]}
    if run.choice is not None:  # auto, from the costs measured before the model was cut
        found["chosen"] = {"where": run.choice.where, "predicted_step_s": run.choice.steps}
    return found


def _peek(batches, skip: int, count: int) -> list[Batch]:
    """The `count` batches after the next `skip` of the stream, read by position without moving it.

    >>> from hp.train.data import TokenBatches
    >>> stream = TokenBatches([{"input_ids": [i], "labels": [i]} for i in range(3)], 1, seed=0, pad_id=0)
    >>> [int(b.input_ids) for b in _peek(stream, 1, 3)] == [int(next(stream).input_ids) for _ in range(4)][1:]
    True
    """
    stream = getattr(batches, "batches", batches)  # a prefetching loader's own stream
    ahead = itertools.islice(positions_from(stream.epoch, stream.index, len(stream)), skip, skip + count)
    return [stream.batch_at(epoch, index) for epoch, index in ahead]


def _merged(parts: list[Batch], pad_id: int, device: str, replica: tuple[int, int] = (0, 1),
            vision_start: int | None = None) -> dict:
    """The accumulated batches as one batch (right-padded to the longest), each sample's loss divisor its own
    batch's supervised tokens times their count; of each batch only `replica`'s share of rows ((index, count):
    the index-th of count equal shares, with their images, each opened by the `vision_start` token)."""
    divisors = [float((b.labels[:, 1:] != IGNORE_INDEX).sum()) * len(parts) for b in parts]  # the whole batch's
    if replica[1] > 1:
        parts = [_share(b, replica, vision_start) for b in parts]
    longest = max(b.input_ids.shape[1] for b in parts)

    def joined(name: str, fill: int) -> torch.Tensor | None:
        found = [getattr(b, name) for b in parts if getattr(b, name) is not None]
        return torch.cat([F.pad(t, (0, longest - t.shape[1]), value=fill) for t in found]) if found else None

    merged = {"input_ids": joined("input_ids", pad_id), "labels": joined("labels", IGNORE_INDEX),
              "mm_token_type_ids": joined("mm_token_type_ids", 0),
              "supervised": torch.cat([torch.full((len(b.input_ids),), d) for b, d in zip(parts, divisors)])}
    for name in ("pixel_values", "image_grid_thw"):
        found = [getattr(b, name) for b in parts if getattr(b, name) is not None]
        merged[name] = torch.cat(found) if found else None
    return {k: v.to(device) if v is not None else v for k, v in merged.items()}


def _share(batch: Batch, replica: tuple[int, int], vision_start: int | None) -> Batch:
    """`replica`'s share of `batch`'s rows, with the images and patches of those rows.

    >>> b = Batch(torch.tensor([[7, 1], [2, 3], [7, 7], [2, 2]]), torch.zeros(4, 2, dtype=torch.long),
    ...           pixel_values=torch.arange(6.0).view(6, 1), image_grid_thw=torch.tensor([[1, 1, 2]] * 3))
    >>> share = _share(b, (1, 2), vision_start=7)  # rows 2 and 3: the second and third image
    >>> share.input_ids.tolist(), share.pixel_values.view(-1).tolist()
    ([[7, 7], [2, 2]], [2.0, 3.0, 4.0, 5.0])
    """
    index, count = replica
    n = len(batch.input_ids) // count
    rows = slice(index * n, (index + 1) * n)
    picked = {"input_ids": batch.input_ids[rows], "labels": batch.labels[rows]}
    if batch.mm_token_type_ids is not None:
        picked["mm_token_type_ids"] = batch.mm_token_type_ids[rows]
    if batch.image_grid_thw is not None:
        images = (batch.input_ids == vision_start).sum(-1).tolist()
        first, last = sum(images[:rows.start]), sum(images[:rows.stop])
        sizes = batch.image_grid_thw.prod(-1).tolist()
        picked["image_grid_thw"] = batch.image_grid_thw[first:last]
        picked["pixel_values"] = batch.pixel_values[sum(sizes[:first]):sum(sizes[:last])]
    return Batch(**picked)

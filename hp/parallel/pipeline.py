"""`hp.pipeline`: a model cut into stages over the mesh's `pp` axis, each stage laid out on the other axes.

Why: a model that outgrows one node's tensor and data parallel is cut
layer-wise; each group of pp ranks holds a run of its blocks and passes the
residual stream on. hp adds the layouts, not a scheduler: the schedules are
`torch.distributed.pipelining`'s (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), named by the strategy.

- **Where to cut**: `hp.parallel.pipeline_split` balances the stages by what
  each block, the embedding and the head with its loss cost (or takes
  `pp_split`); the split is printed by `Pipeline.describe()`.
- **A stage is the model itself**, with what other stages hold replaced by
  `Skipped` stand-ins: parameter names stay the model's own (a checkpoint
  moves between pp degrees), and the model's own forward runs, from
  `input_ids` in the first stage and from `inputs_embeds` (the residual
  stream as received) in the others, with the final norm and head skipped
  but in the last. A rank with several stages (looped and V schedules) holds
  a copy cut for each.
- **Each stage is laid out** by `hp.apply_strategy` with the strategy
  without pp, on the mesh without the `pp` axis: tp, sp, dp, FSDP, cp
  (Ulysses and ring) and ep as anywhere else (the DTensor path: the stage's loss runs outside its
  forward, which plain data parallel's row slicing does not follow).
- **Between stages** each rank sends its own block of the residual stream,
  a plain tensor, to the rank at the same coordinates of the next stage,
  which assembles it in the stream's layout (`hp.from_local`); the stream is
  already padded and, under ring attention, in head-tail order, so later
  stages arrange only what they compute themselves (the rotary tables).
- **The loss is exact**: the head's logits of each micro-batch meet their
  labels in the last stage, and each micro-batch's summed token losses are
  divided by the supervised tokens of the whole batch, so the micro-batches'
  losses add up to the unsharded step's mean however the `-100` labels fall,
  and the schedule does not rescale gradients.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp.layouts import from_local, shard
from hp.ops.region import region
from hp.parallel.apply import apply_strategy, stream_layout, token_layout
from hp.parallel.model_plan import ModelPlan
from hp.parallel.pipeline_split import BlockCosts, StageSplit, balanced_split
from hp.parallel.plain_dp import USED_OUTSIDE_FORWARD
from hp.parallel.sequence import ARRANGED_STREAM, IGNORE_INDEX, arrange, shift
from hp.parallel.strategy import Strategy
from hp.parallel.ties import ties_head

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # a rank holds stage r and stage 2 pp - 1 - r


class PipelineError(ValueError):
    """A batch or model a pipeline cannot run: named before any stage starts."""


class Skipped(nn.Module):
    """What stands in for a module another stage holds: hands its first input back unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def stage_split(model: nn.Module, strategy: Strategy, plan: ModelPlan, *, seq: int = 4096) -> StageSplit:
    """The strategy's `pp_split`, else the split balanced by the blocks' costs for `seq`-token sequences.

    >>> from transformers import AutoConfig
    >>> from hp.models import plan_for
    >>> model = torch.nn.Module()
    >>> model.config = AutoConfig.for_model("llama", num_hidden_layers=8, vocab_size=128256)
    >>> print(stage_split(model, Strategy(pp=4), plan_for(model.config)))  # a 128k vocabulary's head: 2-3 blocks
    stage 0: embedding, blocks 0-1 | stage 1: blocks 2-4 | stage 2: blocks 5-6 | stage 3: block 7, head
    >>> print(stage_split(model, Strategy(pp=2, pp_split=(5, 3)), plan_for(model.config)))
    stage 0: embedding, blocks 0-4 | stage 1: blocks 5-7, head
    """
    if strategy.pp_split is not None:
        return StageSplit.of_counts(strategy.pp_split)
    costs = BlockCosts.of(model.config, seq=seq, recompute=strategy.recompute)
    return balanced_split(costs, strategy.pp_stages)


def stages_of_rank(strategy: Strategy, pp_rank: int) -> list[int]:
    """The stages pp rank `pp_rank` runs: one; several in a loop (r, r + pp, ...); or two in a V.

    >>> stages_of_rank(Strategy(pp=4), 1), stages_of_rank(Strategy(pp=4, pp_schedule="Interleaved1F1B"), 1)
    ([1], [1, 5])
    >>> stages_of_rank(Strategy(pp=4, pp_schedule="ZBVZeroBubble"), 1)
    [1, 6]
    """
    if strategy.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * strategy.pp - 1 - pp_rank]
    return [pp_rank + k * strategy.pp for k in range(strategy.stages_per_rank)]


def cut(model: nn.Module, plan: ModelPlan, split: StageSplit, stage: int | None) -> nn.Module:
    """`model`, changed in place to hold only what `stage` of `split` runs (the rest `Skipped`; stage None:
    none of them, what a rank running only another program keeps of the model)."""
    blocks = model.get_submodule(plan.blocks)
    if len(blocks) != split.bounds[-1]:
        raise PipelineError(f"the split {split} covers {split.bounds[-1]} blocks; {plan.blocks} has {len(blocks)}")
    for i in range(len(blocks)):
        if stage is None or i not in split.blocks(stage):
            blocks[i] = Skipped()
    if stage != 0:
        model.set_submodule(plan.embedding, Skipped())
    if stage != split.stages - 1:
        for name in (plan.norm, plan.head):
            if name is not None:
                model.set_submodule(name, Skipped())
    return model


class _StageRun(nn.Module):
    """What `PipelineStage` runs for one stage: the stage's model from ids or from the received stream,
    handing on its own block of the stream (or, last, of the logits)."""

    def __init__(self, model: nn.Module, index: int, stages: int, stream: str, mesh) -> None:
        super().__init__()
        self.model, self.index, self.stages, self.stream, self.mesh = model, index, stages, stream, mesh
        self.first, self.last = index == 0, index == stages - 1
        self.logits_spec = None  # the last stage's logits layout, to assemble them again for the loss
        self.hidden: list[torch.Tensor] = []
        if not self.last:  # the stream as the base model hands it on (what follows it, a logit soft-cap, is the head's)
            model.base_model.register_forward_hook(lambda mod, args, out: self.hidden.append(out[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            out = self.model(input_ids=x, use_cache=False).logits
        else:
            stream = from_local(x, self.stream, self.mesh) if self.mesh is not None else x
            out = self.model(inputs_embeds=stream, use_cache=False).logits
        if not self.last:
            out = self.hidden.pop()
        if isinstance(out, DTensor):
            if self.last:
                self.logits_spec = (out.device_mesh, out.placements, out.shape, out.stride())
            out = out.to_local()
        # the zero-bubble schedules detach a stage's output in place once its input gradient is out:
        # not a view (of the skipped head's slice, or of a DTensor's local block)
        return out.clone() if out._base is not None else out


@dataclasses.dataclass
class Pipeline:
    """This rank's pipeline stages and the schedule that runs a step over micro-batches.

    `step(input_ids, labels)` runs the forward and backward of every micro-batch and returns the
    step's loss (the mean over the batch's supervised tokens) on every rank; the gradients are then
    in the stage models' parameters, pending over dp and cp as under `hp.apply_strategy`
    (`hp.reduce_gradients` resolves them).
    """

    stages: list[nn.Module]  # this rank's stage models, in stage order
    split: StageSplit
    strategy: Strategy
    runs: list[_StageRun]
    group: Any
    inner_mesh: Any
    plan: ModelPlan
    device: torch.device
    _items: float = 0.0
    _tied_shape: tuple[int, ...] | None = None
    _schedules: dict = dataclasses.field(default_factory=dict)  # batch shape -> its schedule

    def schedule(self, shape: tuple[int, ...], train: bool = True):
        """The schedule for batches of `shape`, training or evaluating: torch's stages size their receive
        buffers by the first batch they see, so each shape (a sequence length, say) gets its own, built
        when first met."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        if (shape, train) not in self._schedules:
            stages = [PipelineStage(run, run.index, run.stages, self.device, group=self.group) for run in self.runs]
            kind = get_schedule_class(self.strategy.pp_schedule)
            on = stages[0] if issubclass(kind, PipelineScheduleSingle) else stages
            self._schedules[shape, train] = kind(on, self.strategy.microbatches, loss_fn=self.loss, scale_grads=False)
        return self._schedules[shape, train]

    def parameters(self):
        for model in self.stages:
            yield from model.parameters()

    def named_parameters(self):
        for model in self.stages:
            yield from model.named_parameters()

    def counted_parameters(self) -> list[nn.Parameter]:
        """`parameters()`, less the head's copy of a head tied to the embedding where another stage holds the
        embedding's: over the pipeline, each parameter once (what a global gradient norm sums, as on one
        device)."""
        if not ties_head(self.stages[0], self.plan):
            return list(self.parameters())
        copies = [_tied_weight(m, self.plan) for m in self.stages
                  if isinstance(m.get_submodule(self.plan.embedding), Skipped)]  # the head's, if any
        return [p for p in self.parameters() if all(p is not w for w in copies)]

    def describe(self) -> str:
        return f"pipeline ({self.strategy.pp_schedule}, {self.strategy.microbatches} micro-batches): {self.split}"

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of the batch's micro-batches; the batch's mean loss (times `scale`, which
        also scales the gradients: 1 / the accumulated batches, say) on every rank."""
        loss = self._run(input_ids, labels, scale, train=True)
        self._sum_tied_gradients()
        return loss

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, forward only (no gradients), on every rank."""
        if self.strategy.pp_schedule in V_SCHEDULES:
            raise PipelineError(f"evaluating under {self.strategy.pp_schedule} is not available: torch's V schedules "
                                "run forward and backward together; evaluate with GPipe, 1F1B or a looped schedule")
        with torch.no_grad():
            return self._run(input_ids, labels, 1.0, train=False)

    def _run(self, input_ids: torch.Tensor, labels: torch.Tensor, scale: float, train: bool) -> torch.Tensor:
        input_ids, labels = _whole_microbatches(input_ids, labels, self.strategy.microbatches)
        self._items = int((labels[..., 1:] != IGNORE_INDEX).sum()) / scale
        if self._items == 0:
            raise PipelineError("the batch has no supervised token (every label is -100)")
        losses: list[torch.Tensor] = []
        first, last = any(run.first for run in self.runs), any(run.last for run in self.runs)
        args = (input_ids,) if first else ()
        schedule = self.schedule(tuple(input_ids.shape), train)
        run = schedule.step if train else schedule.eval
        run(*args, target=labels if last else None, losses=losses,
            **({"return_outputs": False} if train else {}))
        local = torch.stack([_whole(l).detach() for l in losses]).sum() if last else torch.zeros(())
        total = local.to(torch.float32).clone()
        dist.all_reduce(total, group=self.group)  # only the last stage's ranks hold it
        return total

    def _sum_tied_gradients(self) -> None:
        """A tied embedding and head live in the first and the last stage, one copy each: each copy's
        gradient becomes their sum (one all-reduce over pp; ranks holding neither add zeros)."""
        if not ties_head(self.stages[0], self.plan):
            return
        held = [w for w in (_tied_weight(m, self.plan) for m in self.stages) if w is not None]
        if self._tied_shape is None:  # the ranks holding neither learn the local shape once
            shape = torch.tensor(list(_local(held[0]).shape) if held else [0, 0])
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.group)
            self._tied_shape = tuple(shape.tolist())
        dtype = next(self.parameters()).dtype
        total = torch.zeros(self._tied_shape, dtype=dtype)  # a frozen copy (no gradient) adds nothing
        for w in held:
            if w.grad is not None:
                total += _local(w.grad)
        dist.all_reduce(total, group=self.group)
        for w in held:
            if w.grad is not None:
                _local(w.grad).copy_(total)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's summed token losses over the whole batch's supervised tokens."""
        run = next(r for r in self.runs if r.last)
        model = run.model
        logits = output
        if run.logits_spec is not None:
            mesh, placements, shape, stride = run.logits_spec
            logits = DTensor.from_local(output, mesh, placements, run_check=False, shape=shape, stride=stride)
        inner = self.strategy.within_stage
        # what each position of the logits predicts, padded and ordered as the sequence (sequence preparation's)
        targets = arrange(shift(labels), inner, IGNORE_INDEX)
        tokens = token_layout(inner)
        if isinstance(logits, DTensor) and tokens != "b s":
            targets = shard(targets, tokens, self.inner_mesh)
        vocab = model.config.get_text_config().vocab_size
        with region():
            return model.loss_function(logits=logits, labels=None, shift_labels=targets, vocab_size=vocab,
                                       num_items_in_batch=self._items)


def pipeline(model: nn.Module, mesh, strategy: Strategy | Mapping[str, Any], plan: ModelPlan, *,
             seq: int = 4096, device: torch.device | None = None) -> Pipeline:
    """`model` cut into this rank's stages over `mesh`'s `pp` axis, each laid out by `strategy` without pp.

    `mesh` is `hp.strategy_mesh(strategy)` (pp outermost); `seq` is the sequence length the split
    balances the blocks' costs for; `device` the stages' (their parameters', unless on meta). Run
    with `Pipeline.step(input_ids, labels)` on every rank (the whole batch; each stage takes what it
    needs), then reduce and step as usual
    (docs/pipeline.md; tests/workers/pipeline_gloo.py runs it on gloo ranks).

    >>> import hp
    >>> from transformers import AutoModelForCausalLM
    >>> from hp.models import plan_for, tiny_config
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
    >>> hp.pipeline(model, None, {"pp": 4}, plan_for(model.config))
    Traceback (most recent call last):
    ...
    hp.parallel.strategy.StrategyError: pp = 4 x 1 stages per rank makes 4 stages for num_hidden_layers = 2: each stage needs a block; lower pp
    """
    strategy = Strategy.of(strategy)
    strategy.check_fits(model.config)
    split = stage_split(model, strategy, plan, seq=seq)
    pp_rank, group = mesh.get_local_rank("pp"), mesh.get_group("pp")
    inner = strategy.within_stage
    names = [n for n in mesh.mesh_dim_names if n != "pp"]
    inner_mesh = mesh[tuple(names)] if names else None
    stream = stream_layout(inner)
    ids = stages_of_rank(strategy, pp_rank)
    runs = []
    for k, stage in enumerate(ids):
        own = model if k == len(ids) - 1 else copy.deepcopy(model)
        cut(own, plan, split, stage)
        setattr(own, USED_OUTSIDE_FORWARD, True)  # a stage's loss runs outside its forward
        setattr(own, ARRANGED_STREAM, stage > 0)  # later stages get the stream padded and ordered
        if inner_mesh is not None:
            apply_strategy(own, inner_mesh, inner, plan)
        runs.append(_StageRun(own, stage, split.stages, stream, inner_mesh))
    runs.sort(key=lambda run: run.index)
    device = device or next(runs[0].model.parameters()).device
    result = Pipeline([run.model for run in runs], split, strategy, runs, group, inner_mesh, plan, device)
    for run in runs:
        setattr(run.model, PIPELINE, result)
    return result


PIPELINE = "_hp_pipeline"  # set on each stage model: the pipeline that runs it


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline `model` is a stage of (None for a model that is not cut into stages)."""
    return getattr(model, PIPELINE, None)


def _whole_microbatches(input_ids: torch.Tensor, labels: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch with rows of padding added (token 0, nothing supervised) until `n` micro-batches split it
    evenly: they add nothing to the loss.

    >>> ids, labels = _whole_microbatches(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long), 2)
    >>> ids.shape, labels[-1].tolist()
    (torch.Size([4, 2]), [-100, -100])
    """
    extra = -input_ids.shape[0] % n
    if not extra:
        return input_ids, labels
    pad = input_ids.new_zeros((extra, *input_ids.shape[1:]))
    return torch.cat([input_ids, pad]), torch.cat([labels, torch.full_like(pad, IGNORE_INDEX)])


def _tied_weight(model: nn.Module, plan: ModelPlan) -> torch.Tensor | None:
    """The tied embedding / head weight this stage model holds, if either."""
    for name in (plan.embedding, plan.head):
        module = model.get_submodule(name)
        if not isinstance(module, Skipped):
            return module.weight
    return None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t

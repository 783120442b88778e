"""A policy and its frozen reference as two programs: level 3's models side by side (DPO, KTO).

A preference step's reference forward depends on nothing the policy
computes, so `policy_and_reference` makes it a program of its own that runs
a batch ahead: its log-probabilities for batch t + 1 are computed during
step t, wherever the planner finds the policy's ranks idle, and reach the
policy's last stage in step t + 1. Staggered (the default), the
reference's stage s runs a further `stages - 1 - s` batches ahead, so that
no reference stage waits on another within a step and every one of its
forwards can fill a bubble (`hp.mpmd.graph.Program.stagger`). The numbers
are those of the step without it: the reference is frozen, so when it runs
does not change what it computes.

Both models are cut into pipeline stages by `hp.parallel.pipeline.cut`
(parameter names stay the model's own): the policy's stage i on
`policy_ranks[i]`, the reference's on `reference_ranks[i]`: the same ranks
(in the policy's bubbles) or ranks of their own. Given the `rank` it runs
on, the policy is cut in place to that rank's stage (none when it runs only
the reference), so an optimizer over the policy's parameters steps this
rank's share; a `reference` given is cut in place too.

A micro-batch is one group of rows scored together, e.g. a DPO pair (its
chosen and its rejected answer): the batch is a dict with `input_ids` and
`labels` of shape (micro-batches, rows, tokens), prompt tokens labelled
-100. The policy's last stage returns `loss(policy_logps, reference_logps,
labels)` of each micro-batch, from the rows' summed log-probabilities of
their labels (`sequence_logps`; a loss on per-token means counts the
labels); `dpo_loss` is DPO's sigmoid loss for pairs.

KTO (`reference_point`: a batch's micro-batches) judges single answers,
against a reference point: the mean over the batch's mismatched pairs (the
prompt with another example's answer) of the policy's log-probability less
the reference's, without gradient, at least 0. A micro-batch's rows are an
answer and its mismatched pair, and `desirable` says whether the answer
is. The reference scores both rows. The policy trains on the answer, and
its forward of the pair without gradient is a third program, `kl`: the
policy's own stages, in the step (it needs the step's weights). Its last
stage subtracts the reference's log-probability and a gathering flow
(`hp.mpmd.graph.Flow.gather`) brings each batch's terms to every loss of
the batch: `loss(policy_logp, reference_logp, terms, batch, m)`;
`kto_loss` is KTO's loss with weights 1.

>>> import torch
>>> from transformers import AutoModelForCausalLM
>>> from hp.models import plan_for, tiny_config
>>> policy = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
>>> programs = policy_and_reference(policy, plan_for(policy.config), policy_ranks=(0, 1), microbatches=4,
...                                 loss=dpo_loss(beta=0.1, pairs=4))
>>> [(p.name, p.ahead, p.stagger) for p in programs.graph.programs]
[('policy', 0, False), ('reference', 1, True)]
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from hp.mpmd.graph import Flow, Graph, Node, Program
from hp.mpmd.layout import Layout, local, sequence_logps
from hp.mpmd.programs import Programs, even_split, tied_stages
from hp.parallel.apply import apply_strategy
from hp.parallel.model_plan import ModelPlan
from hp.parallel.pipeline import cut
from hp.parallel.pipeline_split import StageSplit
from hp.parallel.strategy import Strategy

# (policy's, reference's row log-probs, the rows' labels) -> the micro-batch's loss
PairLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (policy's, reference's log-prob of the answer, the group's reference point terms, the batch, the micro-batch)
# -> the micro-batch's loss
KtoLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict, int], torch.Tensor]

_BOTH, _ANSWER, _MISMATCHED = slice(None), slice(0, 1), slice(1, 2)  # a micro-batch's rows each program reads


def policy_and_reference(policy: nn.Module, plan: ModelPlan, *, policy_ranks: tuple[int, ...], microbatches: int,
                         loss: PairLoss | KtoLoss, reference: nn.Module | None = None,
                         reference_ranks: tuple[int, ...] | None = None, stagger: bool = True,
                         split: tuple[int, ...] | None = None, rank: int | None = None,
                         reference_point: int = 0, strategy: Strategy | None = None, mesh=None,
                         zero_bubble: bool = False) -> Programs:
    """`policy` and its frozen `reference` (default: a copy of the policy as it is now) as programs (see the
    module); `split`: blocks per stage (even by default); `rank`: build only the stages it runs;
    `reference_point` > 0: KTO's, over groups of that many micro-batches (see the module); `strategy` (tp,
    sp) and `mesh`: each stage laid out by it on `mesh` (`hp.mpmd.Placed(planes=tp)`'s tensor parallel group),
    its stream crossing as each rank's own block; `zero_bubble`: the policy's stages split their backward
    (`Program.split`)."""
    reference_ranks = tuple(reference_ranks or policy_ranks)
    if len(reference_ranks) != len(policy_ranks):
        raise ValueError(f"reference_ranks = {reference_ranks}: the reference is cut into the policy's "
                         f"{len(policy_ranks)} stages")
    tied = tied_stages(policy, plan, "policy")
    frozen = copy.deepcopy(policy) if reference is None else reference  # before the policy is cut
    frozen.requires_grad_(False)
    cuts = StageSplit.of_counts(split or even_split(len(policy.get_submodule(plan.blocks)), len(policy_ranks)))
    graph = pair_graph(policy_ranks, reference_ranks, microbatches, stagger, reference_point, zero_bubble)
    held = {"policy": _stages(policy, plan, cuts, policy_ranks, rank),
            "reference": _stages(frozen, plan, cuts, reference_ranks, rank)}
    if strategy is not None:
        for stages in held.values():
            for stage in stages.values():
                apply_strategy(stage, mesh, strategy, plan)
    layout = Layout(strategy, mesh) if strategy is not None else None
    if reference_point:
        held["kl"] = held["policy"]  # KTO's forward of the mismatched pairs runs the policy's own stages
        ends = {"policy": (_ANSWER, lambda lp, batch, m, inputs: loss(lp, inputs[-1][:1], inputs[-2], batch, m)),
                "kl": (_MISMATCHED, lambda lp, batch, m, inputs: lp - inputs[-1][1:])}
    else:
        ends = {"policy": (_BOTH, lambda lp, batch, m, inputs: loss(lp, inputs[-1], batch["labels"][m]))}
    ends["reference"] = (_BOTH, lambda lp, batch, m, inputs: lp)
    last = len(policy_ranks) - 1
    fns: dict[Node, Callable] = {}
    modules: dict[Node, nn.Module] = {}
    for program in graph.programs:
        rows, finish = ends[program.name]
        for s, stage in held[program.name].items():
            modules[program.name, s] = stage
            fns[program.name, s] = _stage(stage, s == 0, s == last, rows, finish, layout)
    return Programs(graph, fns, modules, tied=tied)


def _stages(model: nn.Module, plan: ModelPlan, cuts: StageSplit, ranks: tuple[int, ...],
            rank: int | None) -> dict[int, nn.Module]:
    """`model`'s pipeline stages by index: `rank`'s own (`model` cut in place; none when it holds no stage of
    it), or every stage, each a copy."""
    if rank is None:
        return {s: cut(copy.deepcopy(model), plan, cuts, s) for s in range(len(ranks))}
    mine = ranks.index(rank) if rank in ranks else None
    cut(model, plan, cuts, mine)
    return {} if mine is None else {mine: model}


def pair_graph(policy_ranks: tuple[int, ...], reference_ranks: tuple[int, ...], microbatches: int,
               stagger: bool = True, reference_point: int = 0, zero_bubble: bool = False) -> Graph:
    """The policy's stages on `policy_ranks` (their backward split with `zero_bubble`), its frozen reference's
    a batch ahead on `reference_ranks`, the reference's last stage feeding the policy's last; with
    `reference_point` (KTO), the policy's forward of the mismatched pairs on the policy's ranks, its groups
    gathered by the policy's last stage.

    >>> [p.ranks for p in pair_graph((0, 1), (2, 3), 4).programs]
    [(0, 1), (2, 3)]
    >>> [f.gather for f in pair_graph((0, 1), (0, 1), 4, reference_point=2).flows]
    [0, 0, 2]
    """
    last = len(policy_ranks) - 1
    programs = [Program("policy", tuple(policy_ranks), split=zero_bubble),
                Program("reference", tuple(reference_ranks), trains=False, ahead=1, stagger=stagger)]
    flows = [Flow(("reference", last), ("policy", last))]
    if reference_point:
        programs.append(Program("kl", tuple(policy_ranks), trains=False))
        flows += [Flow(("reference", last), ("kl", last)), Flow(("kl", last), ("policy", last), gather=reference_point)]
    return Graph(tuple(programs), tuple(flows), microbatches)


def _stage(stage: nn.Module, first: bool, last: bool, rows: slice, finish: Callable,
           layout: Layout | None) -> Callable:
    """A stage's function on `rows` of each micro-batch: the last's ends in `finish(log-probs, batch, m, inputs)`;
    a laid-out stage's stream comes and goes as this rank's block (`hp.mpmd.layout`)."""
    def run(batch: dict, m: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        if first:
            out = stage(input_ids=batch["input_ids"][m][rows], use_cache=False).logits
        else:
            out = stage(inputs_embeds=inputs[0] if layout is None else layout.stream(inputs[0]), use_cache=False).logits
        if not last:
            return local(out)  # the norm and the head are skipped: the residual stream
        return finish(sequence_logps(out, batch["labels"][m][rows], layout), batch, m, inputs)
    return run


def dpo_loss(beta: float, pairs: int) -> PairLoss:
    """DPO's sigmoid loss of one (chosen, rejected) pair, over the batch's `pairs` (their sum is the mean).

    >>> logps = torch.tensor([-1.0, -2.0])
    >>> float(dpo_loss(0.1, 2)(logps, logps, None))  # log 2 / 2
    0.3465735912322998
    """
    def loss(policy: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        margin = (policy[0] - reference[0]) - (policy[1] - reference[1])
        return -nn.functional.logsigmoid(beta * margin) / pairs
    return loss


def kto_loss(beta: float, examples: int) -> KtoLoss:
    """KTO's loss of one answer (desirable or not: the batch's `desirable`), weights 1, over the step's
    `examples` (their sum is the mean), its reference point the mean of its group's terms, at least 0.

    >>> zero = torch.zeros(1)
    >>> float(kto_loss(0.1, 2)(zero, zero, torch.zeros(2), {"desirable": torch.tensor([True])}, 0))  # 0.5 / 2
    0.25
    """
    def loss(policy: torch.Tensor, reference: torch.Tensor, kl: torch.Tensor, batch: dict, m: int) -> torch.Tensor:
        point, ratio = kl.mean().clamp(min=0), policy[0] - reference[0]
        margin = ratio - point if bool(batch["desirable"][m]) else point - ratio
        return (1 - torch.sigmoid(beta * margin)) / examples
    return loss


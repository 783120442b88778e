"""`hp train`'s dpo stage under `parallel.mpmd: {place: {reference: pp | N | auto}}`: the policy and its reference as programs.

`hp.mpmd`'s level 3 (`hp.mpmd.reference.policy_and_reference`): the
policy is cut into `pp` pipeline stages, one per rank, and its frozen
reference into as many, on the same ranks (`pp`: its forwards fill the
policy's bubbles) or on `pp` ranks of their own. The reference's forward
depends on nothing the policy computes, so it runs a batch ahead, each of
its stages a further batch ahead than the next (staggered): its
log-probabilities for a step's pairs were computed in earlier steps and
reach the policy's last stage when the step needs them. It is frozen, so
when it runs changes nothing it computes.

A micro-batch is one pair (its chosen and its rejected answer), and a step
is every pair of the accumulated batches. Each pair's loss is
`hp.train.preference.dpo`'s (the config's loss, label smoothing and
`pref_ftx`) divided by the step's pairs: the batches of a step hold as
many pairs each, so the step's loss is hp train's mean of per-batch means
(under dp, a step's pairs are every replica's: each replica takes its
share of each batch's pairs). The rewards the reports show are summed on the policy's last stage and
shared with every rank after the step.

Under `reference: auto` the `pp` ranks are shared the faster way
(`hp.mpmd.choice`): one block's forward and backward are measured on the
whole model (a pair of `cutoff_len` tokens) before it is cut, and the
policy over every rank with the reference in its bubbles is planned and
replayed against the policy over half of them with the reference on the
other half.

The reference is the one the unplaced stage uses (`ref_model`, or the
starting model): under LoRA without `ref_model`, a copy of the policy with
its adapters off (`hp.parallel.lora.base_copy`), taken before any
checkpoint is restored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp.models import plan_for
from hp.mpmd.choice import Choice, block_costs, choose_reference
from hp.mpmd.programs import Programs
from hp.mpmd.reference import policy_and_reference
from hp.parallel.lora import base_copy
from hp.parallel.placement import AUTO
from hp.train.config import Preference, TrainConfig
from hp.train.data import IGNORE_INDEX, Batch
from hp.train.objectives import Reference, pair_losses


class PairLosses:
    """Each pair's DPO loss (`hp.train.objectives.pair_losses`) over a step of `pairs` pairs, its rewards kept for the report (see the module).

    >>> from hp.train.config import Preference
    >>> losses = PairLosses(Preference(beta=0.1), pairs=2)
    >>> labels = torch.tensor([[-100, 5, 6], [-100, 7, -100]])
    >>> round(float(losses(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0]), labels)), 4)  # log 2 / 2
    0.3466
    """

    def __init__(self, pref: Preference, pairs: int, device: torch.device | str = "cpu") -> None:
        self.pref, self.pairs, self.device = pref, pairs, device  # device: where the report's sums are reduced
        self.kept: list[torch.Tensor] = []  # per pair: chosen and rejected rewards, chosen and rejected log-probs

    def __call__(self, policy: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss, judged = pair_losses(policy, (labels[:, 1:] != IGNORE_INDEX).sum(-1), reference, self.pref)
        self.kept.append(torch.cat([judged.chosen, judged.rejected, policy.detach()]).float())  # on the device
        return loss.sum() / self.pairs

    def metrics(self) -> dict[str, float]:
        """The step's rewards and log-probs under LlamaFactory's names, the same on every rank (a collective)."""
        kept = torch.stack(self.kept).to(self.device) if self.kept else torch.zeros(0, 4, device=self.device)
        self.kept.clear()
        sums = torch.cat([kept.sum(0), (kept[:, 0] > kept[:, 1]).sum().view(1), kept.new_tensor([len(kept)])])
        sums = sums.double()
        dist.all_reduce(sums)
        chosen, rejected, logp_chosen, logp_rejected, right, n = (sums / sums[-1]).tolist()
        return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/accuracies": right,
                "rewards/margins": chosen - rejected, "logps/chosen": logp_chosen, "logps/rejected": logp_rejected}


def policy_programs(model: nn.Module, reference: Reference, config: TrainConfig, pairs: PairLosses,
                    microbatches: int, rank: int) -> tuple[Programs, Choice | None]:
    """`model` (the policy) cut in place to what `rank` (of its replica) runs, beside its reference's stages
    (see the module), `microbatches` pairs a step; under `reference: auto`, how the ranks were shared and each
    way's predicted step."""
    strategy = config.parallel
    plan = plan_for(model.config)
    frozen = base_copy(reference.model) if reference.adapters else reference.model  # before the policy is cut
    choice = None
    if strategy.mpmd_place.where == AUTO:  # measured on the whole model, before it is cut
        costs = block_costs(model, plan, config.cutoff_len, group=dist.group.WORLD)
        choice = choose_reference(costs, world=strategy.pp, blocks=len(model.get_submodule(plan.blocks)),
                                  microbatches=microbatches)
        policy_ranks, reference_ranks = choice.ranks
    else:
        policy_ranks, reference_ranks = tuple(range(strategy.pp)), strategy.mpmd_place.ranks(strategy.pp)
    programs = policy_and_reference(model, plan, policy_ranks=policy_ranks, reference_ranks=reference_ranks,
                                    microbatches=microbatches, loss=pairs, reference=frozen, split=strategy.pp_split,
                                    rank=rank)
    return programs, choice


def pairs_batch(parts: list[Batch], pad_id: int, device: str, replica: tuple[int, int] = (0, 1)) -> dict:
    """The accumulated pairwise batches (chosen rows first, rejected after) as one batch of pairs: `input_ids`
    and `labels` of shape (pairs, 2, tokens), right-padded to the longest; of each batch only `replica`'s
    share of pairs ((index, count): the index-th of count equal shares).

    >>> b = Batch(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-100, 2], [-100, 4]]))
    >>> pairs_batch([b, b], 0, "cpu")["input_ids"].tolist()
    [[[1, 2], [3, 4]], [[1, 2], [3, 4]]]
    """
    longest = max(b.input_ids.shape[1] for b in parts)
    index, count = replica

    def paired(name: str, fill: int) -> torch.Tensor:
        rows = []
        for b in parts:
            t = F.pad(getattr(b, name), (0, longest - getattr(b, name).shape[1]), value=fill)
            half = len(t) // 2
            share = half // count
            pairs = torch.stack([t[:half], t[half:]], 1)
            rows.append(pairs[index * share:(index + 1) * share])
        return torch.cat(rows).to(device)

    return {"input_ids": paired("input_ids", pad_id), "labels": paired("labels", IGNORE_INDEX)}

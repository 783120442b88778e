"""`hp train`'s dpo and kto stages under `parallel.mpmd: {place: {reference: pp | N | auto}}`: the policy and its reference as programs.

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

In the kto stage a micro-batch is one answer and its mismatched pair (the
prompt with another example's answer), and each batch's reference point
(`hp.train.preference.kto`: the mean over the batch's mismatched pairs of
the policy's log-probability less the reference's) is gathered from the
policy's forward of the pairs, a program of its own in the step
(`hp.mpmd.reference`). Each answer's loss is divided by its batch's
answers and the step's batches, and `pref_ftx`'s term by its batch's
desirable answers, which is the plain stage's mean of per-batch means; the
rewards and the reference point are reported per batch and averaged, as the
plain stage does. The reference point is a whole batch's, so kto is placed
without data parallel replicas.

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
from hp.train import preference
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


class KtoLosses:
    """Each answer's KTO loss (`hp.train.preference.kto`, the config's weights and `pref_ftx`) over a step of
    `batches` batches of `answers` each, its reward and its batch's reference point kept for the report (see
    the module).

    >>> from hp.train.config import Preference
    >>> losses = KtoLosses(Preference(beta=0.1), answers=2, batches=1)
    >>> batch = {"labels": torch.tensor([[[-100, 5], [-100, 6]]] * 2), "desirable": torch.tensor([True, False])}
    >>> float(losses(torch.zeros(1), torch.zeros(1), torch.zeros(2), batch, 0))  # 0.5 / 2
    0.25
    """

    def __init__(self, pref: Preference, answers: int, batches: int, device: torch.device | str = "cpu") -> None:
        self.pref, self.answers, self.batches, self.device = pref, answers, batches, device
        self.kept: list[torch.Tensor] = []  # per answer: its batch, desirable, reward, the batch's reference point

    def __call__(self, policy: torch.Tensor, reference: torch.Tensor, terms: torch.Tensor, batch: dict,
                 m: int) -> torch.Tensor:
        desirable, first = batch["desirable"], m // self.answers * self.answers
        judged = preference.kto(policy, reference, terms, torch.zeros_like(terms), desirable[m:m + 1], self.pref)
        loss = judged.losses.sum() / self.answers
        if self.pref.ftx and bool(desirable[m]):  # over the batch's desirable answers, per token
            counted = (batch["labels"][m][0, 1:] != IGNORE_INDEX).sum()
            loss = loss - self.pref.ftx * policy.sum() / counted / desirable[first:first + self.answers].sum()
        reward = torch.cat([judged.chosen, judged.rejected])  # the one answer's, desirable or not
        self.kept.append(torch.cat([policy.new_tensor([m // self.answers, bool(desirable[m])]), reward.float(),
                                    judged.kl.view(1).float()]))
        return loss / self.batches

    def metrics(self) -> dict[str, float]:
        """The step's mean over its batches of each batch's rewards and reference point, as the plain kto stage
        reports them (`hp.train.preference.Judged.metrics`), the same on every rank (a collective)."""
        sums = torch.zeros(self.batches, 5, dtype=torch.float64, device=self.device)  # per batch
        for batch, desirable, reward, kl in (torch.stack(self.kept).tolist() if self.kept else []):  # one copy
            sums[int(batch)] += torch.tensor([reward * desirable, desirable, reward * (1 - desirable), 1 - desirable,
                                              kl], dtype=torch.float64, device=self.device)
        self.kept.clear()
        dist.all_reduce(sums)
        answers = sums[:, 1] + sums[:, 3]
        chosen = torch.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1].clamp(min=1), 0.0)
        rejected = torch.where(sums[:, 3] > 0, sums[:, 2] / sums[:, 3].clamp(min=1), 0.0)
        chosen, rejected, kl = float(chosen.mean()), float(rejected.mean()), float((sums[:, 4] / answers).mean())
        return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected, "kl": kl}


def policy_programs(model: nn.Module, reference: Reference, config: TrainConfig, losses: PairLosses | KtoLosses,
                    microbatches: int, rank: int, laid_out: dict | None = None) -> tuple[Programs, Choice | None]:
    """`model` (the policy) cut in place to what `rank` (of its replica) runs, beside its reference's stages
    (see the module), `microbatches` pairs (kto: answers) a step, each stage laid out as `laid_out` says
    (`strategy`, `mesh`: under tp); under `reference: auto`, how the ranks were shared and each way's
    predicted step."""
    strategy = config.parallel
    plan = plan_for(model.config)
    frozen = base_copy(reference.model) if reference.adapters else reference.model  # before the policy is cut
    point = config.per_device_train_batch_size if config.stage == "kto" else 0  # answers per reference point
    choice = None
    if strategy.mpmd_place.where == AUTO:  # measured on the whole model, before it is cut
        costs = block_costs(model, plan, config.cutoff_len, group=dist.group.WORLD)
        choice = choose_reference(costs, world=strategy.pp, blocks=len(model.get_submodule(plan.blocks)),
                                  microbatches=microbatches, reference_point=point,
                                  zero_bubble=strategy.mpmd_zero_bubble)
        policy_ranks, reference_ranks = choice.ranks
    else:
        policy_ranks, reference_ranks = tuple(range(strategy.pp)), strategy.mpmd_place.ranks(strategy.pp)
    programs = policy_and_reference(model, plan, policy_ranks=policy_ranks, reference_ranks=reference_ranks,
                                    microbatches=microbatches, loss=losses, reference=frozen, split=strategy.pp_split,
                                    rank=rank, reference_point=point, zero_bubble=strategy.mpmd_zero_bubble,
                                    **(laid_out or {}))
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
            t = _padded(getattr(b, name), longest, fill)
            half = len(t) // 2
            share = half // count
            pairs = torch.stack([t[:half], t[half:]], 1)
            rows.append(pairs[index * share:(index + 1) * share])
        return torch.cat(rows).to(device)

    return {"input_ids": paired("input_ids", pad_id), "labels": paired("labels", IGNORE_INDEX)}


def feedback_batch(parts: list[Batch], pad_id: int, device: str) -> dict:
    """The accumulated kto batches as one batch of answers, each with its mismatched pair: `input_ids` and
    `labels` of shape (answers, 2, tokens), right-padded to the longest, and `desirable` (answers,).

    >>> b = Batch(torch.tensor([[1, 2, 3]]), torch.tensor([[-100, 2, 3]]), kl=Batch(torch.tensor([[1, 4]]),
    ...           torch.tensor([[-100, 4]])), desirable=torch.tensor([True]))
    >>> feedback_batch([b], 0, "cpu")["input_ids"].tolist()
    [[[1, 2, 3], [1, 4, 0]]]
    """
    longest = max(t.input_ids.shape[1] for b in parts for t in (b, b.kl))

    def rows(name: str, fill: int) -> torch.Tensor:
        return torch.cat([torch.stack([_padded(getattr(b, name), longest, fill), _padded(getattr(b.kl, name), longest,
                                                                                          fill)], 1) for b in parts])

    return {"input_ids": rows("input_ids", pad_id).to(device), "labels": rows("labels", IGNORE_INDEX).to(device),
            "desirable": torch.cat([b.desirable for b in parts]).to(device)}


def _padded(t: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """`t`'s rows right-padded with `fill` to `length` tokens."""
    return F.pad(t, (0, length - t.shape[1]), value=fill)


"""The preference losses, as published, on per-sequence log-probabilities and scores.

Each function takes one value per sequence (plain tensors: the objectives
gather them from the laid-out model first, `hp.train.objectives`) and returns
the loss of each pair or example with the implicit rewards that
LlamaFactory and TRL report. With `r = beta * (log pi(y|x) - log ref(y|x))`
and `z = (log pi(yc) - log pi(yr)) - (log ref(yc) - log ref(yr))`:

    sigmoid (DPO)  -(1 - eps) log s(beta z) - eps log s(-beta z)   eps: dpo_label_smoothing
    hinge (SLiC)   max(0, 1 - beta z)
    ipo            (z - 1 / (2 beta))^2                 on per-token mean log-probs
    simpo          -log s(beta (m(yc) - m(yr)) - gamma) on per-token means m, no reference
    orpo           -m(yc) - beta log s(log odds(yc) - log odds(yr)), odds(y) = e^m / (1 - e^m), no reference
    kto            w_d (1 - s(beta (rc - kl')))  for a desirable answer,  w_u (1 - s(beta (kl' - rr)))  else,
                   kl' = max(0, mean over the batch's mismatched pairs of log pi - log ref), held constant
    rm             -log s(score(yc) - score(yr))         (Bradley-Terry, a value head's last-token score)

SimPO's and ORPO's rewards are `beta * m`. `pref_ftx` adds its weight times
the chosen (KTO: desirable) answers' mean per-token negative log-likelihood
to each pair's (example's) loss, as LlamaFactory does; its KTO term is the
plain mean over desirable answers (LlamaFactory's rescales it by the
batch's share of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hp.train.config import Preference

MEAN_LOSSES = ("ipo", "simpo", "orpo")  # compare per-token mean log-probs, not sums


@dataclass(frozen=True)
class Judged:
    """A batch's losses (one per pair or example) and the rewards its answers got, as the reports show them."""

    losses: torch.Tensor
    chosen: torch.Tensor  # rewards of the chosen (desirable) answers
    rejected: torch.Tensor  # rewards of the rejected (undesirable) answers
    kl: torch.Tensor | None = None  # KTO's reference point

    def metrics(self) -> dict[str, float]:
        """LlamaFactory's names: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins (KTO: kl).

        Accuracies and margins compare the two answers of a pair; KTO's answers are not paired, so they
        compare the mean rewards of its desirable and undesirable answers.
        """
        chosen, rejected = self.chosen.detach().float(), self.rejected.detach().float()
        out = {"rewards/chosen": _mean(chosen), "rewards/rejected": _mean(rejected)}
        if self.kl is None:
            out["rewards/accuracies"] = float((chosen > rejected).float().mean())
            out["rewards/margins"] = float((chosen - rejected).mean())
        else:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
            out["kl"] = float(self.kl)
        return out


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else 0.0


def dpo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
        ref_rejected: torch.Tensor | None, pref: Preference) -> Judged:
    """The losses of `pref.loss` for pairs with policy log-probs `chosen`, `rejected` (sums, or per-token
    means for MEAN_LOSSES) and the reference's (None for the reference-free losses).

    >>> lp = torch.tensor([-1.0]), torch.tensor([-3.0])
    >>> round(dpo(*lp, *lp, Preference()).losses.item(), 4)  # z = 0: log 2
    0.6931
    """
    beta = pref.beta
    if not pref.uses_reference:
        return _reference_free(chosen, rejected, pref)
    z = (chosen - rejected) - (ref_chosen - ref_rejected)
    if pref.loss == "sigmoid":
        eps = pref.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)
    elif pref.loss == "hinge":
        losses = torch.relu(1 - beta * z)
    else:  # ipo
        losses = (z - 1 / (2 * beta)) ** 2
    return Judged(losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach())


def _reference_free(chosen: torch.Tensor, rejected: torch.Tensor, pref: Preference) -> Judged:
    beta = pref.beta
    if pref.loss == "simpo":
        losses = -F.logsigmoid(beta * (chosen - rejected) - pref.simpo_gamma)
    else:  # orpo: log odds of a mean log-prob m are m - log(1 - e^m)
        log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
        losses = -chosen - beta * F.logsigmoid(log_odds)
    return Judged(losses, beta * chosen.detach(), beta * rejected.detach())


def kto(logps: torch.Tensor, ref_logps: torch.Tensor, kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor,
        desirable: torch.Tensor, pref: Preference) -> Judged:
    """KTO's losses for answers with policy and reference log-probs, judged `desirable` (bool) or not; the
    reference point comes from the batch's mismatched pairs (`kl_logps`, `ref_kl_logps`), without gradient.

    >>> zero = torch.zeros(2)
    >>> kto(zero, zero, zero, zero, torch.tensor([True, False]), Preference()).losses.tolist()
    [0.5, 0.5]
    """
    kl = (kl_logps - ref_kl_logps).detach().mean().clamp(min=0)
    ratio = logps - ref_logps
    desired = pref.kto_chosen_weight * (1 - torch.sigmoid(pref.beta * (ratio - kl)))
    undesired = pref.kto_rejected_weight * (1 - torch.sigmoid(pref.beta * (kl - ratio)))
    losses = torch.where(desirable, desired, undesired)
    rewards = pref.beta * ratio.detach()
    return Judged(losses, rewards[desirable], rewards[~desirable], kl)


def pairwise(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> Judged:
    """The reward model's Bradley-Terry losses for pairs of scores; the scores are the rewards reported.

    >>> pairwise(torch.tensor([2.0]), torch.tensor([2.0])).losses  # even odds: log 2
    tensor([0.6931])
    """
    losses = -F.logsigmoid(chosen_scores.float() - rejected_scores.float())
    return Judged(losses, chosen_scores.detach(), rejected_scores.detach())

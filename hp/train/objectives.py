"""What a micro-batch's loss is, stage by stage, on a laid-out model.

pt and sft take the model's own next-token loss. The preference stages need
a number per sequence: the summed log-probability of its supervised labels
(`label_logps`), or a value head's score at its last token (`last_scores`).
Both are computed from the model's outputs as they come back under the
strategy (split by vocab, sequence, batch: `hp.parallel.sequence.arrange` lays the
labels and the last-token mask along the sequence the same way, and
cross-entropy on vocab-split logits never gathers them), then gathered whole:
one number per sequence, tiny beside the activations. The losses are then
the published formulas of `hp.train.preference` on plain tensors, the same
on every rank, so gradients equal the unsharded computation's.

A pairwise batch (rm, dpo) holds its chosen answers in its first half of
rows and the rejected ones in the second, as LlamaFactory's collator
concatenates them; a KTO batch holds its answers, their mismatched pairs
(`Batch.kl`) and whether each answer is desirable. The reference model
(`Reference`) is a frozen copy laid out like the policy, or the policy
itself with its LoRA adapters off; it runs without gradient.

An objective returns the loss to run backward from and the metrics of the
micro-batch (`hp.train.preference.Judged.metrics`, and the policy's mean
log-probs of chosen and rejected answers).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import hp
from hp.parallel.lora import adapters_off
from hp.parallel.sequence import arrange, shift
from hp.parallel.strategy import Strategy
from hp.train import preference
from hp.train.config import Preference
from hp.train.data import IGNORE_INDEX, Batch
from hp.train.model import VALUE_HEAD


@dataclass
class Outcome:
    """A micro-batch's loss (backward runs from it) and what it reports."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def whole(values: torch.Tensor) -> torch.Tensor:
    """`values` as one plain tensor on every rank (a DTensor is gathered, keeping its gradient's path)."""
    return values.full_tensor() if isinstance(values, DTensor) else values


def output_labels(labels: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    """The label each output position predicts (the next token's), laid along the sequence as the outputs are."""
    return arrange(shift(labels), strategy, IGNORE_INDEX)


def label_logps(model: nn.Module, batch: Batch, strategy: Strategy, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each row's supervised labels' log-probabilities, their count), whole on every rank.

    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> logps, counts = label_logps(model, Batch(torch.tensor([[1, 2, 3]]), torch.tensor([[-100, 2, 3]])), Strategy(), "cpu")
    >>> counts.tolist(), bool(logps[0] < 0)
    ([2], True)
    """
    logits = model(input_ids=batch.input_ids.to(device)).logits
    labels = output_labels(batch.labels.to(device), strategy)
    rows, length = labels.shape
    with hp.region():
        nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        sums = -nll.view(rows, length).sum(-1)
    return whole(sums), (batch.labels[:, 1:] != IGNORE_INDEX).sum(-1).to(device)


def last_scores(model: nn.Module, batch: Batch, strategy: Strategy, device: str) -> torch.Tensor:
    """The value head's score of each row at its last supervised token (its answer's end), whole on every rank."""
    hidden = model(input_ids=batch.input_ids.to(device), output_hidden_states=True).hidden_states[-1]
    supervised = batch.labels != IGNORE_INDEX
    last = (torch.arange(supervised.shape[1]) * supervised).argmax(-1)  # right padding: the answer ends each row
    mask = F.one_hot(last, supervised.shape[1]).float().to(device)
    with hp.region():
        values = model.get_submodule(VALUE_HEAD)(hidden).squeeze(-1)
        scores = (values * arrange(mask, strategy, 0.0)).sum(-1)
    return whole(scores)


class Reference:
    """The model a preference loss compares with: a frozen copy, or the policy with its adapters off.

    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> policy = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> reference = Reference(policy, adapters=True)  # the policy's base weights, no gradient
    """

    def __init__(self, model: nn.Module, *, adapters: bool = False) -> None:
        self.model = model
        self.adapters = adapters  # True: `model` is the LoRA policy, read with its adapters off

    def logps(self, batch: Batch, strategy: Strategy, device: str) -> torch.Tensor:
        off = adapters_off(self.model) if self.adapters else nullcontext()
        with torch.no_grad(), off:
            return label_logps(self.model, batch, strategy, device)[0]


class LanguageModeling:
    """pt and sft: the model's mean cross-entropy over the supervised tokens."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, batch: Batch, device: str) -> Outcome:
        return Outcome(self.model(**batch.inputs(device)).loss)  # input_ids and labels, and a VL model's images


class Dpo:
    """dpo: pairs of answers to one prompt, chosen first, under `pref.loss` (`hp.train.preference.dpo`)."""

    def __init__(self, model: nn.Module, reference: Reference | None, strategy: Strategy, pref: Preference) -> None:
        self.model, self.reference, self.strategy, self.pref = model, reference, strategy, pref

    def __call__(self, batch: Batch, device: str) -> Outcome:
        logps, counts = label_logps(self.model, batch, self.strategy, device)
        reference = self.reference.logps(batch, self.strategy, device) if self.pref.uses_reference else None
        losses, judged = pair_losses(logps, counts, reference, self.pref)
        pairs = len(counts) // 2
        metrics = {**judged.metrics(), "logps/chosen": float(logps[:pairs].detach().mean()),
                   "logps/rejected": float(logps[pairs:].detach().mean())}
        return Outcome(losses.mean(), metrics)


def pair_losses(logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None,
                pref: Preference) -> tuple[torch.Tensor, preference.Judged]:
    """Each pair's loss under `pref` and the rewards judged: `logps` the rows' summed label log-probabilities
    (chosen rows first, rejected after), `counts` their labels, `reference` the reference's (None for the
    reference-free losses); per-token means where the loss compares them, and `pref_ftx`'s term.

    >>> lp = torch.tensor([-1.0, -3.0])
    >>> round(pair_losses(lp, torch.tensor([1, 1]), lp, Preference())[0].item(), 4)  # z = 0: log 2
    0.6931
    """
    means = pref.loss in preference.MEAN_LOSSES
    compared = logps / counts if means else logps
    pairs = len(counts) // 2
    ref_chosen = ref_rejected = None
    if reference is not None:
        ref = reference / counts if means else reference
        ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
    judged = preference.dpo(compared[:pairs], compared[pairs:], ref_chosen, ref_rejected, pref)
    losses = judged.losses
    if pref.ftx:
        losses = losses - pref.ftx * logps[:pairs] / counts[:pairs]
    return losses, judged


class Kto:
    """kto: single answers judged desirable or not, against the batch's mismatched pairs (`hp.train.preference.kto`)."""

    def __init__(self, model: nn.Module, reference: Reference, strategy: Strategy, pref: Preference) -> None:
        self.model, self.reference, self.strategy, self.pref = model, reference, strategy, pref

    def __call__(self, batch: Batch, device: str) -> Outcome:
        logps, counts = label_logps(self.model, batch, self.strategy, device)
        with torch.no_grad():
            kl_logps, _ = label_logps(self.model, batch.kl, self.strategy, device)
        ref = self.reference.logps(batch, self.strategy, device)
        ref_kl = self.reference.logps(batch.kl, self.strategy, device)
        desirable = batch.desirable.to(device)
        judged = preference.kto(logps, ref, kl_logps, ref_kl, desirable, self.pref)
        loss = judged.losses.mean()
        if self.pref.ftx and bool(desirable.any()):
            loss = loss - self.pref.ftx * (logps / counts)[desirable].mean()
        return Outcome(loss, judged.metrics())


class Reward:
    """rm: a value head's score at each answer's last token, chosen above rejected (`hp.train.preference.pairwise`)."""

    def __init__(self, model: nn.Module, strategy: Strategy) -> None:
        self.model, self.strategy = model, strategy

    def __call__(self, batch: Batch, device: str) -> Outcome:
        scores = last_scores(self.model, batch, self.strategy, device)
        pairs = len(scores) // 2
        judged = preference.pairwise(scores[:pairs], scores[pairs:])
        return Outcome(judged.losses.mean(), judged.metrics())

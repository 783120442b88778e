"""Sequences prepared once, before a model whose sequence is split (context or sequence parallel).

When cp or sp splits the sequence, three things must happen on the whole
sequence, before any rank holds only its part:

- labels are shifted once (`shift_labels`, which HF's causal-LM loss takes
  as given), so no label crosses a split;
- a sequence whose length is not a multiple of the strategy's chunk count is
  right-padded to one, with the pad token and label -100 (a given padding
  mask with 0, given positions continued); causal attention keeps real tokens
  blind to the padding, so loss and gradients are unchanged, and the returned
  logits include the padded positions;
- under ring attention the tokens, labels and RoPE's cos/sin are permuted to
  head-tail order (`hp.ops.ring_attention.head_tail_order`), so every rank
  does the same causal work; the logits come back in that order
  (`logits[:, argsort(order)]` restores it).

Padding masks and explicit `position_ids` are refused under cp (packed and
padded batches are not supported there yet); an all-ones mask is dropped.
"""

from __future__ import annotations

import fnmatch
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from hp.model_plan import ModelPlan
from hp.ops.ring_attention import head_tail_order
from hp.strategy import Strategy

IGNORE_INDEX = -100


def as_keywords(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A forward call's arguments, all by name (HF's `**kwargs` flattened in)."""
    named = dict(signature.bind_partial(*args, **kwargs).arguments)
    named.update(named.pop("kwargs", {}))
    return named


def prepare_sequences(model: nn.Module, strategy: Strategy, plan: ModelPlan) -> None:
    """Hook `model`'s forward to shift, pad and order its sequences as the module docstring says."""
    pad_id = getattr(model.config, "pad_token_id", None)
    pad_id = 0 if pad_id is None else pad_id
    signature = inspect.signature(model.forward)

    def before(mod, args, kwargs):
        return (), prepare(as_keywords(signature, args, kwargs), strategy, pad_id)

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    if strategy.ring and plan.rotary is not None:
        for name, module in model.named_modules():
            if fnmatch.fnmatchcase(name, plan.rotary):
                module.register_forward_hook(_head_tail_rotary(strategy.cp))


def prepare(kwargs: dict, strategy: Strategy, pad_id: int) -> dict:
    """The forward's keyword arguments with labels shifted, sequences padded and ordered.

    >>> s = Strategy(cp=2, cp_algorithm="ring")
    >>> out = prepare({"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]])}, s, 0)
    >>> out["input_ids"].tolist(), out["labels"].tolist()  # padded to 4 = 2 cp, head-tail order
    ([[5, 0, 6, 7]], [[6, -100, 7, -100]])
    """
    if strategy.cp > 1:
        _refuse_what_cp_cannot_honour(kwargs)
    seq = next(kwargs[k].shape[1] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        kwargs["shift_labels"] = F.pad(kwargs["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    extra = -seq % strategy.sequence_chunks
    order = head_tail_order(seq + extra, strategy.cp) if strategy.ring else None
    fills = {"input_ids": pad_id, "inputs_embeds": 0.0, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
    for key, fill in fills.items():
        value = kwargs.get(key)
        if value is None:
            continue
        if extra:
            value = F.pad(value, (0, 0) * (value.ndim - 2) + (0, extra), value=fill)
        kwargs[key] = value if order is None else value[:, order.to(value.device)]
    if kwargs.get("position_ids") is not None and extra:  # the padding continues the positions
        last = kwargs["position_ids"][..., -1:]
        more = last + torch.arange(1, extra + 1, device=last.device)
        kwargs["position_ids"] = torch.cat([kwargs["position_ids"], more], dim=-1)
    if kwargs.get("shift_labels") is not None:
        kwargs["labels"] = kwargs["shift_labels"]  # HF computes the loss only when labels are given
    return kwargs


def _head_tail_rotary(cp: int):
    def hook(mod, args, out):  # cos and sin, (b, s, d), in the tokens' order
        return tuple(t[:, head_tail_order(t.shape[1], cp).to(t.device)] for t in out)

    return hook


def _refuse_what_cp_cannot_honour(kwargs: dict) -> None:
    """Explicit positions and padding masks under cp; an all-ones mask is dropped (it masks nothing)."""
    if kwargs.get("position_ids") is not None:
        raise ValueError("position_ids are not supported under context parallelism (positions follow the tokens)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("padding masks are not supported under context parallelism: pack or trim the batch")

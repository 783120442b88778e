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
  (`logits[:, argsort(order)]` restores it). So are the positions a function
  of the modeling module takes as its first argument, `position_ids`, when
  the model computes per-token values from them (BEAM's query scaling on its
  NoPE layers): such a function sees the tokens' positions in their order.

Padding masks and explicit `position_ids` are refused under cp (packed and
padded batches are not supported there yet); an all-ones mask is dropped.
M-RoPE's 3-D positions (`(3, b, s)`, computed on the whole sequence) are taken.

A vision-language model (`ModelPlan.decoder`) scatters its images into the
text by the placeholders' order, so its tokens keep their order up to the
decoder: only the labels are permuted at the model's input, and the
decoder's embeddings (with Qwen3-VL's deepstack positions and features) at
the decoder's.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hp.parallel.model_plan import ModelPlan, held_blocks
from hp.parallel.parallelize import forward_inside
from hp.ops.ring_attention import head_tail_order
from hp.parallel.strategy import Strategy

IGNORE_INDEX = -100
# Set on a model whose `inputs_embeds` arrive already padded and ordered (a later pipeline stage's: the
# stream as the stage before handed it on): only the labels are arranged.
ARRANGED_STREAM = "_hp_arranged_stream"
# The cp size of the ring-ordered forwards running now, innermost last. A plain stack, not a ContextVar:
# `torch.compile` traces (and guards on) a module global's read, not ContextVar.get.
_RING_CP: list[int] = []


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
        order = plan.decoder is None and not getattr(mod, ARRANGED_STREAM, False)
        return (), prepare(as_keywords(signature, args, kwargs), strategy, pad_id, order_tokens=order)

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    if strategy.ring and plan.decoder is not None:
        model.get_submodule(plan.decoder).register_forward_pre_hook(_head_tail_decoder_input(strategy.cp),
                                                                    with_kwargs=True, prepend=True)
    if strategy.ring and plan.rotary is not None:
        for name, module in model.named_modules():
            if fnmatch.fnmatchcase(name, plan.rotary):
                module.register_forward_hook(_head_tail_rotary(strategy.cp))
    if strategy.ring:
        _position_functions_in_token_order(model, plan)
        forward_inside(model.get_submodule(plan.decoder) if plan.decoder else model, lambda: _ring_forward(strategy.cp))


def prepare(kwargs: dict, strategy: Strategy, pad_id: int, *, order_tokens: bool = True) -> dict:
    """The forward's keyword arguments with labels shifted, sequences padded and ordered.

    With `order_tokens` False only the labels take head-tail order (the tokens do at the decoder).

    >>> s = Strategy(cp=2, cp_algorithm="ring")
    >>> out = prepare({"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]])}, s, 0)
    >>> out["input_ids"].tolist(), out["labels"].tolist()  # padded to 4 = 2 cp, head-tail order
    ([[5, 0, 6, 7]], [[6, -100, 7, -100]])
    """
    if strategy.cp > 1:
        _refuse_what_cp_cannot_honour(kwargs)
    seq = next(kwargs[k].shape[1] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        kwargs["shift_labels"] = shift(kwargs["labels"])
    extra = -seq % strategy.sequence_chunks
    fills = {"input_ids": pad_id, "inputs_embeds": 0.0, "mm_token_type_ids": 0, "shift_labels": IGNORE_INDEX,
             "attention_mask": 0}
    for key, fill in fills.items():
        if kwargs.get(key) is not None:
            kwargs[key] = arrange(kwargs[key], strategy, fill, order=order_tokens or key == "shift_labels")
    if kwargs.get("position_ids") is not None and extra:  # the padding continues the positions
        last = kwargs["position_ids"][..., -1:]
        more = last + torch.arange(1, extra + 1, device=last.device)
        kwargs["position_ids"] = torch.cat([kwargs["position_ids"], more], dim=-1)
    if kwargs.get("shift_labels") is not None:
        kwargs["labels"] = kwargs["shift_labels"]  # HF computes the loss only when labels are given
    return kwargs


def shift(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: the next token's (-100 at the end), as HF's causal-LM loss shifts them.

    >>> shift(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def arrange(values: torch.Tensor, strategy: Strategy, fill: float | int, *, order: bool = True) -> torch.Tensor:
    """A per-token tensor (b, s, ...) laid along the sequence as the model's outputs come back under `strategy`:
    right-padded with `fill` to a multiple of the sequence chunks and, under ring attention (`order`), in
    head-tail order. A loss that weighs each position of the logits or hidden states (a label, a mask)
    arranges its weights so; without a split sequence they are returned as they are.

    >>> arrange(torch.tensor([[1, 2, 3]]), Strategy(cp=2, cp_algorithm="ring"), 0).tolist()
    [[1, 0, 2, 3]]
    """
    if not strategy.splits_sequence:
        return values
    extra = -values.shape[1] % strategy.sequence_chunks
    if extra:
        values = F.pad(values, (0, 0) * (values.ndim - 2) + (0, extra), value=fill)
    if strategy.ring and order:
        values = values[:, head_tail_order(values.shape[1], strategy.cp).to(values.device)]
    return values


def _head_tail_rotary(cp: int):
    def hook(mod, args, out):  # cos and sin, (b, s, d), in the tokens' order; DeepSeek-V2's one complex tensor
        if isinstance(out, torch.Tensor):
            return out[:, head_tail_order(out.shape[1], cp).to(out.device)]
        return tuple(t[:, head_tail_order(t.shape[1], cp).to(t.device)] for t in out)

    return hook


def _position_functions_in_token_order(model: nn.Module, plan: ModelPlan) -> None:
    """Replace, once per process, each function of the blocks' modeling module whose first parameter is
    `position_ids` by one that, inside a ring-ordered forward, passes it the positions of the tokens as
    they lie (head-tail order); elsewhere it is the function itself."""
    blocks = held_blocks(model, plan)
    modeling = sys.modules[type(blocks[0]).__module__] if blocks else None
    for name, function in inspect.getmembers(modeling, inspect.isfunction) if modeling is not None else ():
        if function.__module__ != modeling.__name__ or hasattr(function, "hp_token_order"):
            continue
        first = next(iter(inspect.signature(function).parameters), None)
        if first == "position_ids":
            setattr(modeling, name, _in_token_order(function))


def _in_token_order(function):
    @functools.wraps(function)
    def in_token_order(position_ids, *args, **kwargs):
        # The model counts positions 0, 1, ... along the sequence as it lies; under ring attention the
        # token at place i is token order[i] of the sequence.
        if _RING_CP and isinstance(position_ids, torch.Tensor) and not isinstance(position_ids, DTensor):
            order = head_tail_order(position_ids.shape[-1], _RING_CP[-1]).to(position_ids.device)
            position_ids = position_ids[..., order]
        return function(position_ids, *args, **kwargs)

    in_token_order.hp_token_order = True
    return in_token_order


@contextmanager
def _ring_forward(cp: int):
    _RING_CP.append(cp)
    try:
        yield
    finally:
        _RING_CP.pop()


def _head_tail_decoder_input(cp: int):
    """A pre-hook that puts a vision-language decoder's input in head-tail order.

    Qwen3-VL's deepstack adds features at the visual positions (`visual_pos_masks`), one row per
    position in the mask's order: the mask is permuted with the tokens, and the rows so that the
    k-th visual position of the permuted mask gets its own row.
    """

    def hook(mod, args, kwargs):
        embeds = kwargs["inputs_embeds"]
        order = head_tail_order(embeds.shape[1], cp).to(embeds.device)
        kwargs["inputs_embeds"] = _Reordered.apply(embeds, order)
        mask = kwargs.get("visual_pos_masks")
        if mask is not None:
            row = (mask.flatten().cumsum(0) - 1).view(mask.shape)  # each visual position's row
            kwargs["visual_pos_masks"] = mask[:, order]
            rows = row[:, order][kwargs["visual_pos_masks"]]
            kwargs["deepstack_visual_embeds"] = [e[rows] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    return hook


class _Reordered(torch.autograd.Function):
    """`x[:, order]` for a permutation `order`, whose gradient is the gradient reordered back.

    The plain index's backward scatters into zeros (`index_put`), which torch 2.11's DTensor
    cannot lay out when the gradient is a pending sum; reordering keeps it one, on every release.
    """

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return _take(x, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _take(grad, torch.argsort(order)), None


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor):
        index = DTensor.from_local(index, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
    return x[:, index]


def _refuse_what_cp_cannot_honour(kwargs: dict) -> None:
    """Explicit positions and padding masks under cp; an all-ones mask is dropped (it masks nothing).

    M-RoPE's positions (3, b, s) are whole-sequence positions, not packing: they are taken.
    """
    positions = kwargs.get("position_ids")
    if positions is not None and positions.ndim != 3:
        raise ValueError("position_ids are not supported under context parallelism (positions follow the tokens)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("padding masks are not supported under context parallelism: pack or trim the batch")

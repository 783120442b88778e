"""Ulysses context parallelism around any HF attention implementation.

hp's context-parallel kernels take over `F.scaled_dot_product_attention`.
Some families never call it: Gemma-2 runs HF's "eager" attention (a matmul,
logit soft-capping, an additive sliding-window mask, a softmax), which DTensor
would run on a split sequence by all-gathering keys and values. Ulysses needs
no knowledge of what attention computes: an all-to-all turns `heads,
s/cp` into `heads/cp, s`, the family's own attention function runs on whole
sequences for a share of the heads (masks, soft-capping and windows
included), and a second all-to-all turns the result back. So hp registers,
for a model whose attention is not SDPA, an HF attention function that does
exactly that around the model's own implementation, and points the model's
config at it. Ring attention merges SDPA blocks by log-sum-exp and cannot
wrap an opaque function: `apply_strategy` refuses it for such models, but for
one kind it knows. An eager attention whose only additions to a causal
softmax are learned sinks and a sliding window (gpt-oss, Granite-SWA:
`takes_ring`) is what hp's ring kernel computes, given the module's scaling,
sinks and window: `ring_around_attention` points the model there. Nor can
ring take a mask a model always builds for its attention to add to (Doge's
dynamic mask: `own_mask_attention`), laid out in the tokens' order, not
ring's; such a model is refused ring by name before it runs.

Learned attention sinks (gpt-oss, Granite-SWA: one logit per head that
joins every softmax) travel with their heads: the implementation reads
`module.sinks` (and the `s_aux` argument), so on each rank it sees a view
of the module whose sinks are the rank's share of heads. Their gradient
pends over every axis on which ranks attend to other tokens or heads.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Shard

from hp.ops.context_parallel import local_heads, sequence_parallel_attention, swap_heads_and_sequence
from hp.ops.local import to_dtensor

PREFIX = "hp_ulysses_"
RING_PREFIX = "hp_ring_"


def uses_sdpa(model: nn.Module) -> bool:
    """Whether the model's attention calls `F.scaled_dot_product_attention` (hp's CP kernels take it)."""
    return model.config._attn_implementation in ("sdpa", None)


def ulysses_around_attention(model: nn.Module) -> None:
    """Point `model`'s attention at a Ulysses wrapper of its own implementation (module docstring)."""
    _point_at(model, PREFIX, _ulysses)


def takes_ring(model: nn.Module) -> bool:
    """Whether ring attention can stand in for the model's own attention: multi-head attention (its own
    q, k and v projections) with learned sinks and no soft-capping. DeepSeek-V4's, with one compressed
    key-value projection beside its sinks, is not."""
    owners = [name.rpartition(".")[0] for name, _ in model.named_parameters() if name.rpartition(".")[2] == "sinks"]
    plain = all({"q_proj", "k_proj", "v_proj"} <= dict(model.get_submodule(o).named_children()).keys() for o in owners)
    return bool(owners) and plain and getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is None


def own_mask_attention(model: nn.Module) -> str | None:
    """The attention class of a model that always hands its attention a mask, or None.

    Without padding HF builds no mask for SDPA (causal SDPA needs none), unless the model asks for
    one (`allow_is_causal_skip=False`) to add its own terms to: Doge's dynamic mask, ALiBi. Such a
    mask is laid out by position in the tokens' order, which ring attention's head-tail order is not.

    >>> from hp.models import tiny_config
    >>> from hp.models.derive import meta_model
    >>> own_mask_attention(meta_model(tiny_config("doge", layers=1)))
    'DogeAttention'
    >>> own_mask_attention(meta_model(tiny_config("llama", layers=1))) is None
    True
    """
    if not any(_materializes_mask(type(m)) for m in model.modules() if type(m).__name__.endswith("Model")):
        return None
    attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), model)
    return type(attention).__name__


@functools.cache
def _materializes_mask(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # defined outside a source file: nothing to read
        return False
    return "allow_is_causal_skip=False" in source.replace(" ", "")


def paired_heads_attention(model: nn.Module) -> str | None:
    """The class of a differential attention in `model` (DiffLlama's), or None.

    Differential attention subtracts head h + heads/2's softmax from head h's (weighted by a
    lambda re-parameterized as `lambda_q1`, `lambda_k1`, `lambda_q2`, `lambda_k2`) and splits its
    values into halves along the key-value heads: tp's split of the heads in order puts each pair
    on two ranks, and DTensor gathers the heads twice per layer to bring them together.

    >>> from hp.models import tiny_config
    >>> from hp.models.derive import meta_model
    >>> paired_heads_attention(meta_model(tiny_config("diffllama", layers=1)))
    'DiffLlamaAttention'
    """
    for module in model.modules():
        names = {name for name, _ in module.named_parameters(recurse=False)}
        if {"lambda_q1", "lambda_q2"} <= names:
            return type(module).__name__
    return None


def ring_around_attention(model: nn.Module) -> None:
    """Point a `takes_ring` model's attention at hp's ring kernel with its sinks and window (module docstring)."""
    _point_at(model, RING_PREFIX, _ring)


def _ring(impl: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  **kwargs):
        if dropout and module.training:
            raise ValueError(f"{type(module).__name__}: ring attention with sinks takes no attention dropout "
                             f"({dropout}); set it to 0 or use cp_algorithm ulysses")
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        out = sequence_parallel_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True,
                                          sinks=module.sinks, window=window)
        if out is NotImplemented:  # nothing split by sequence here: the implementation as it is
            return _implementation(impl, module)(module, query, key, value, attention_mask, scaling=scaling,
                                                 dropout=dropout, sliding_window=sliding_window, **kwargs)
        return out.transpose(1, 2), None

    return attention


def _point_at(model: nn.Module, prefix: str, make: Callable[[str], Callable]) -> None:
    """Register `make(impl)` as HF attention `prefix + impl` (the same masks as `impl`'s) and point the model at it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    impl = model.config._attn_implementation
    if impl.startswith((PREFIX, RING_PREFIX)):
        return
    AttentionInterface.register(prefix + impl, make(impl))
    AttentionMaskInterface.register(prefix + impl, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    model.config._attn_implementation = prefix + impl


def _implementation(impl: str, module: nn.Module) -> Callable:
    """The function the module would have called: its family's eager one, or HF's registered `impl`."""
    if impl == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _ulysses(impl: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = _implementation(impl, module)
        axis = _sequence_axis(query, key, value)
        if axis is None:  # nothing split by sequence here: the implementation as it is
            return inner(module, query, key, value, attention_mask, **kwargs)
        mesh = query.device_mesh
        group, parts = mesh.get_group(axis), mesh.size(axis)
        q, k, v = (swap_heads_and_sequence(t.to_local(), group, parts, heads_to_seq=True) for t in (query, key, value))
        attention_mask = _batch_share(attention_mask, query)
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            sinks = _heads_share(sinks, query, axis)
            module = _WithSinks(module, sinks)
            kwargs = {**kwargs, "s_aux": sinks} if "s_aux" in kwargs else kwargs
        out, _ = inner(module, q, k, v, attention_mask, **kwargs)  # (b, s, heads/cp, d)
        out = swap_heads_and_sequence(out.transpose(1, 2), group, parts, heads_to_seq=False).transpose(1, 2)
        placements = [_transposed(p) for p in query.placements]  # (b, h, s, d) -> (b, s, h, d)
        b, h, s, d = query.shape
        return to_dtensor(out.contiguous(), mesh, placements, (b, s, h, d)), None

    return attention


def _batch_share(mask: torch.Tensor | None, query: DTensor) -> torch.Tensor | None:
    """The rows of a whole-batch mask that this rank's queries are (their batch may be split, by dp say)."""
    if isinstance(mask, DTensor):
        mask = mask.full_tensor()
    axes = [m for m, p in enumerate(query.placements) if p == Shard(0)]
    if mask is None or not axes or mask.shape[0] == 1:  # a mask of one row is broadcast over the batch
        return mask
    mesh, index, parts = query.device_mesh, 0, 1
    for m in axes:  # a dim split over several axes is split over the first one outermost
        index, parts = index * mesh.size(m) + mesh.get_local_rank(m), parts * mesh.size(m)
    return _share(mask, index, parts)


class _WithSinks:
    """An attention module as one Ulysses rank's implementation sees it: its sinks cut to the rank's heads."""

    def __init__(self, module: nn.Module, sinks: torch.Tensor):
        self._module, self.sinks = module, sinks

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _heads_share(sinks: torch.Tensor, query: DTensor, axis: int) -> torch.Tensor:
    """The sinks of the heads this rank attends with after the swap, as a plain tensor."""
    mesh = query.device_mesh
    return _TakeShare.apply(local_heads(sinks, query), mesh.get_local_rank(axis), mesh.size(axis))


class _TakeShare(torch.autograd.Function):
    """Share `coord` of `parts` of a 1-D tensor; backward, its gradient in place, zeros elsewhere."""

    @staticmethod
    def forward(ctx, t, coord, parts: int):
        ctx.share = (t.shape[0], coord, parts)
        return _share(t, coord, parts)

    @staticmethod
    def backward(ctx, grad):
        return _spread(grad, *ctx.share), None, None


@maybe_run_for_local_tensor  # which share is this rank's depends on its coordinate
def _share(t: torch.Tensor, coord: int, parts: int) -> torch.Tensor:
    """Share `coord` of `parts` of `t`'s first dim."""
    n = t.shape[0] // parts
    return t[coord * n : (coord + 1) * n].clone()


@maybe_run_for_local_tensor
def _spread(grad: torch.Tensor, size: int, coord: int, parts: int) -> torch.Tensor:
    out = grad.new_zeros(size)
    out[coord * grad.shape[0] : (coord + 1) * grad.shape[0]] = grad
    return out


def _sequence_axis(query, key, value) -> int | None:
    """The mesh axis that splits q, k and v by sequence (dim 2), if they are DTensors laid out alike."""
    if not all(isinstance(t, DTensor) for t in (query, key, value)):
        return None
    if not (query.placements == key.placements == value.placements):
        return None
    axes = [m for m, p in enumerate(query.placements) if p == Shard(2)]
    return axes[0] if len(axes) == 1 else None


def _transposed(p):
    """A placement of (b, h, s, d) as a placement of (b, s, h, d)."""
    if isinstance(p, Shard) and p.dim in (1, 2):
        return Shard(3 - p.dim)
    return p


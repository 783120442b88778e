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
wrap an opaque function: `apply_strategy` refuses it for such models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hp.ops.context_parallel import swap_heads_and_sequence
from hp.ops.local import to_dtensor

PREFIX = "hp_ulysses_"


def uses_sdpa(model: nn.Module) -> bool:
    """Whether the model's attention calls `F.scaled_dot_product_attention` (hp's CP kernels take it)."""
    return model.config._attn_implementation in ("sdpa", None)


def ulysses_around_attention(model: nn.Module) -> None:
    """Point `model`'s attention at a Ulysses wrapper of its own implementation (module docstring)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    impl = model.config._attn_implementation
    if impl.startswith(PREFIX):
        return
    name = PREFIX + impl
    AttentionInterface.register(name, _ulysses(impl))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])  # the same masks as before
    model.config._attn_implementation = name


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
        if isinstance(attention_mask, DTensor):
            attention_mask = attention_mask.full_tensor()
        out, _ = inner(module, q, k, v, attention_mask, **kwargs)  # (b, s, heads/cp, d)
        out = swap_heads_and_sequence(out.transpose(1, 2), group, parts, heads_to_seq=False).transpose(1, 2)
        placements = [_transposed(p) for p in query.placements]  # (b, h, s, d) -> (b, s, h, d)
        b, h, s, d = query.shape
        return to_dtensor(out.contiguous(), mesh, placements, (b, s, h, d)), None

    return attention


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


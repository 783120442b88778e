"""Sharding rules for scaled-dot-product attention kernels DTensor has none for.

CPU's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, forward and
backward) splits over batch and heads freely. Its query sequence may be split
too (keys and values stay whole: an all-gather of K/V), except under a causal
mask, whose offsets the kernel takes from local positions: there the rule
keeps the sequence whole and DTensor gathers it. In backward a split query
sequence makes the key and value gradients partial sums. CUDA's flash,
memory-efficient and cuDNN kernels already have DTensor rules; the math path
decomposes into ops that do.
"""

from __future__ import annotations

import torch

from hp.ops.rule import rule

aten = torch.ops.aten


def _forward_whole(query, key, value, dropout_p=0.0, is_causal=False, **_) -> str:
    return "t d e s" if is_causal else "t d e"


def _backward_whole(grad_out, query, key, value, out, lse, dropout_p=0.0, is_causal=False, **_) -> str:
    return "t d e s" if is_causal else "t d e"


rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    "b h s d, b h t d, b h t e -> b h s e, b h s",
    whole=_forward_whole,
)
rule(
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    "b h s e, b h s d, b h t d, b h t e, b h s e, b h s -> b h s d, b h t d, b h t e",
    sum="s",
    whole=_backward_whole,
)

"""Tiny configs of every family in the zoo, built in code (nothing is downloaded).

Tests, benchmarks and examples build real HF models from these: the same
code as the full-size models, at a size where one CPU runs a step in
milliseconds. Every family gets hidden 64, 8 query heads of dim 8, 4
key/value heads (8 for Phi-3, whose fused q, k, v need equal parts), MLP
width 128 and a vocabulary of 256 unless asked otherwise. The mixture-of-
experts families (`MOE_FAMILIES`) route each token to 2 of 8 experts of width
32 (Qwen2-MoE's shared expert: 64); their widths are multiples of 8, which
`torch._grouped_mm` needs on CPU (16-byte-aligned rows in fp32 and bf16).
"""

from __future__ import annotations

from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=128, use_cache=False)
# What each family needs beyond the shape: head_dim where it is not hidden / heads by default,
# Phi-3's equal fused parts and token ids inside the vocabulary.
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"head_dim": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "phi3": {"num_key_value_heads": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8},
}
FAMILIES = tuple(_EXTRA)  # the dense families
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
_EXTRA["qwen2_moe"] = {**_MOE, "shared_expert_intermediate_size": 64}
_EXTRA["qwen3_moe"] = {**_MOE, "head_dim": 8}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")


def tiny_config(model_type: str, layers: int = 2, vocab_size: int = 256, **overrides: Any):
    """A small HF config of `model_type` (a family of the zoo).

    >>> tiny_config("phi3", layers=1).num_key_value_heads
    8
    """
    from transformers import AutoConfig

    if model_type not in _EXTRA:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {', '.join(_EXTRA)}")
    values = {**SHAPE, **_EXTRA[model_type], "num_hidden_layers": layers, "vocab_size": vocab_size, **overrides}
    return AutoConfig.for_model(model_type, **values)

"""Tiny configs of every family in the zoo, built in code (nothing is downloaded).

Tests, benchmarks and examples build real HF models from these: the same
code as the full-size models, at a size where one CPU runs a step in
milliseconds. Every family gets hidden 64, 8 query heads of dim 8, 4
key/value heads (8 for Phi-3, whose fused q, k, v need equal parts), MLP
width 128 and a vocabulary of 256 unless asked otherwise. The mixture-of-
experts families (`MOE_FAMILIES`) route each token to 2 of 8 experts of width
32 (Qwen2-MoE's shared expert: 64); their widths are multiples of 8, which
`torch._grouped_mm` needs on CPU (16-byte-aligned rows in fp32 and bf16);
LongCat-Flash adds 2 zero-computation experts (a token routed there passes
through as it is).
The vision-language families (`VL_FAMILIES`) pair that decoder with a vision
tower of 2 blocks, hidden 32, 2 heads and 4-pixel patches merged 2 x 2 (an
image of 8k x 8k pixels becomes k x k tokens), and place their vision token
ids at the top of the vocabulary (`VISION_TOKENS`).
"""

from __future__ import annotations

from typing import Any

# Images of a tiny vision-language batch, (height, width) in pixels per sample: none, one, two of other sizes.
TINY_IMAGES = ((), ((16, 16),), ((16, 8), (8, 24)), ())

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=128, use_cache=False)
# The one rule for every family's sizes: each attribute its config class has takes the small value here.
SIZES = {
    **SHAPE, "head_dim": 8, "query_pre_attn_scalar": 8, "rotary_dim": 4, "layer_types": None,
    # mixture of experts: 8 experts of width 32, 2 per token, a shared expert of 64, routing groups of 4
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
    "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
    # LongCat-Flash's zero-computation experts: few, so that tokens reach both kinds (its 256 took every token)
    "zero_expert_num": 2,
    # multi-head latent attention (its head_dim is the rope slice's)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
}
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")  # the dense families
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
# Every family whose plan is derived from transformers' own and whose tiny model matches HF under tp
# (`python benchmarks/zoo.py` runs each under every strategy; tests/test_zoo_derived.py under tp).
DERIVED_FAMILIES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "beam", "codegen", "cohere", "cohere2",
    "cohere2_moe", "cwm", "deepseek_v2", "deepseek_v3", "dory", "dots1", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "gemma4_text",
    "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt_neox", "gpt_oss", "gptj", "granite",
    "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1", "laguna", "llama", "longcat_flash",
    "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3",
    "mistral", "mixtral", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "starcoder2",
    "vaultgemma", "youtu",
)
_MOE = {k: SIZES[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}

VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=SHAPE["hidden_size"],
               patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
_VISION_EXTRA = {
    "qwen2_5_vl": {"window_size": 16, "fullatt_block_indexes": [1]},  # windows of 2 x 2 merged tokens
    "qwen3_vl": {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
}
_VISION_EXTRA["qwen3_vl_moe"] = _VISION_EXTRA["qwen3_vl"]
_TEXT = {
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
    "qwen3_vl": {"head_dim": 8, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                                    "mrope_interleaved": True}},
}
_TEXT["qwen3_vl_moe"] = {**_TEXT["qwen3_vl"], **_MOE, "decoder_sparse_step": 1}
# Token ids that the vision-language families reserve, counted back from the top of the vocabulary.
VISION_TOKENS = {"image_token_id": -6, "video_token_id": -5, "vision_start_token_id": -4, "vision_end_token_id": -3}


def tiny_config(model_type: str, layers: int = 2, vocab_size: int = 256, **overrides: Any):
    """A small HF config of `model_type` (a family of the zoo).

    >>> tiny_config("phi3", layers=1).num_key_value_heads
    8
    """
    from transformers import AutoConfig

    if model_type in VL_FAMILIES:
        text = {**SHAPE, **_TEXT[model_type], "num_hidden_layers": layers, "vocab_size": vocab_size,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides}
        tokens = {name: vocab_size + offset for name, offset in VISION_TOKENS.items()}
        return AutoConfig.for_model(model_type, text_config=text, vision_config={**_VISION, **_VISION_EXTRA[model_type]},
                                    tie_word_embeddings=False, **tokens)
    return AutoConfig.for_model(model_type, **{**sizes_for(model_type, layers, vocab_size), **overrides})


def sizes_for(model_type: str, layers: int = 2, vocab_size: int = 256) -> dict[str, Any]:
    """The tiny sizes of one family: `SIZES` where its config class has the attribute.

    Multi-head latent attention keeps its own head_dim (the rope slice); a family whose plan
    fuses q, k and v in one projection gets as many key/value heads as query heads (the fused
    parts split over tp only when equal); dropout and router jitter are off; token ids outside the vocabulary
    move into it.

    >>> sizes_for("phi3")["num_key_value_heads"], sizes_for("llama")["num_key_value_heads"]
    (8, 4)
    """
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    keys = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}))
    values = {k: v for k, v in SIZES.items() if k in keys}
    if "qk_rope_head_dim" in keys:  # latent attention: one key and value per query head
        values.pop("head_dim", None)
        if "head_dim" in keys:  # where a latent family's head_dim is its rope slice's (LongCat-Flash)
            values["head_dim"] = SIZES["qk_rope_head_dim"]
        values["num_key_value_heads"] = values["num_attention_heads"]
    if any("qkv" in k for k in (getattr(cls, "base_model_tp_plan", None) or {})):
        values["num_key_value_heads"] = values["num_attention_heads"]
    if "per_layer_config" in keys:  # Gemma-4's full-attention layers: their own head dim, small too
        values["global_head_dim"] = SIZES["head_dim"]
    values.update(num_hidden_layers=layers, vocab_size=vocab_size)
    if isinstance(getattr(cls, "num_hidden_layers", None), property) and "num_layers" in keys:
        values = {**{k: v for k, v in values.items() if k != "num_hidden_layers"}, "num_layers": layers}  # LongCat's
    for key, value in default.to_dict().items():
        if "dropout" in key or key.endswith(("_pdrop", "jitter_noise")):  # training-mode noise differs run to run
            values[key] = 0.0 if isinstance(value, float) else value
        if key.endswith("_token_id") and isinstance(value, int) and value >= vocab_size:
            values[key] = _TOKEN_IDS.get(key, 3)
    return values


def tiny_vl_batch(model, images=TINY_IMAGES, seq: int = 16, seed: int = 0) -> dict:
    """A batch for a tiny vision-language `model`: random text around each sample's images.

    Each image of (height, width) pixels is its placeholders between vision start and end tokens,
    random patches (`pixel_values`) and its grid; labels ignore the vision tokens; the M-RoPE
    positions come from the model's own `get_rope_index` on the whole batch.

    >>> from transformers import AutoModelForImageTextToText
    >>> batch = tiny_vl_batch(AutoModelForImageTextToText.from_config(tiny_config("qwen2_5_vl")))
    >>> batch["input_ids"].shape, batch["image_grid_thw"].tolist(), tuple(batch["position_ids"].shape)
    (torch.Size([4, 16]), [[1, 4, 4], [1, 4, 2], [1, 2, 6]], (3, 4, 16))
    """
    import torch

    config, g = model.config, torch.Generator().manual_seed(seed)
    vision = config.vision_config
    per_token = vision.patch_size * vision.spatial_merge_size  # pixels of one merged token, each way
    patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    rows, pixels, grids = [], [], []
    for sample in images:
        ids: list[int] = []
        for h, w in sample:
            placeholders = [config.image_token_id] * ((h // per_token) * (w // per_token))
            ids += [*torch.randint(3, 200, (2,), generator=g).tolist(), config.vision_start_token_id, *placeholders,
                    config.vision_end_token_id]
            grids.append((1, h // vision.patch_size, w // vision.patch_size))
            pixels.append(torch.randn(h // vision.patch_size * (w // vision.patch_size), patch, generator=g))
        rows.append(ids + torch.randint(3, 200, (seq - len(ids),), generator=g).tolist())
    ids = torch.tensor(rows)
    types = (ids == config.image_token_id).int()
    batch = {"input_ids": ids, "labels": ids.masked_fill(ids >= config.image_token_id, -100), "mm_token_type_ids": types,
             "pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}
    batch["position_ids"], _ = model.model.get_rope_index(ids, image_grid_thw=batch["image_grid_thw"],
                                                          mm_token_type_ids=types)
    return batch

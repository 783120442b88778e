"""Reference shapes: the published configs of the models people plan for, as HF configs without weights.

`hp plan` answers "will it fit, and how should I split it" before anything
is downloaded or rented, so a user names a model by its shape
(`model_name_or_path: llama-3.1-405b`) as well as by a local directory.
Each entry is the model's published `config.json`, reduced to the fields
that decide parameter shapes; `reference_config` builds transformers' own
config class from it, so the model hp lays out is the one HF would build.
The parameter counts these give are checked against the published ones in
`tests/test_plan.py`.
"""

from __future__ import annotations

from typing import Any

_LLAMA_3 = {"vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False}
_QWEN_3 = {"vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
           "head_dim": 128, "tie_word_embeddings": False}

REFERENCES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                               "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                               "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                               "tie_word_embeddings": True}),
    "llama-3.1-8b": ("llama", {**_LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "num_key_value_heads": 8}),
    "llama-3.1-70b": ("llama", {**_LLAMA_3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                "num_attention_heads": 64, "num_key_value_heads": 8}),
    "llama-3.1-405b": ("llama", {**_LLAMA_3, "hidden_size": 16384, "intermediate_size": 53248,
                                 "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8}),
    "qwen3-32b": ("qwen3", {**_QWEN_3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                            "num_attention_heads": 64, "num_key_value_heads": 8}),
    "qwen3-30b-a3b": ("qwen3_moe", {**_QWEN_3, "hidden_size": 2048, "intermediate_size": 6144,
                                    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                                    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}),
    "qwen3-235b-a22b": ("qwen3_moe", {**_QWEN_3, "hidden_size": 4096, "intermediate_size": 12288,
                                      "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536}),
    "deepseek-v3": ("deepseek_v3", {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
                                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                                    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                    "max_position_embeddings": 163840, "tie_word_embeddings": False}),
    "qwen2.5-vl-72b": ("qwen2_5_vl", {
        "text_config": {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                        "max_position_embeddings": 128000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3456, "num_heads": 16,
                          "out_hidden_size": 8192, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "temporal_patch_size": 2},
        "tie_word_embeddings": False}),
}


def reference_config(name: str):
    """transformers' config of the reference shape `name`, for laying the model out on the meta device.

    >>> reference_config("llama-3.1-8b").num_hidden_layers
    32
    >>> reference_config("llama-4")
    Traceback (most recent call last):
    ...
    ValueError: no reference shape 'llama-4': hp plan knows deepseek-v3, llama-3.1-405b, llama-3.1-70b, \
llama-3.1-8b, qwen2.5-0.5b, qwen2.5-vl-72b, qwen3-235b-a22b, qwen3-30b-a3b, qwen3-32b, or a local HF model directory
    """
    if name not in REFERENCES:
        raise ValueError(f"no reference shape {name!r}: hp plan knows {', '.join(sorted(REFERENCES))}, "
                         "or a local HF model directory")
    from transformers import AutoConfig

    model_type, fields = REFERENCES[name]
    config = AutoConfig.for_model(model_type, **fields)
    config.use_cache = False
    return config

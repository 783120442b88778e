"""The embedded tiny models, built from configs in code, and the HF config of any model a run names.

Why this module exists: a run must start on a machine that downloads
nothing, so hp embeds small models sized for the byte-level tokenizer:
`hp/tiny-llama`, a small Llama, `hp/tiny-qwen3-moe`, a small Qwen3 mixture
of experts (8 experts, top 2, with HF's auxiliary load-balancing loss) for
expert parallel, and `hp/tiny-qwen2.5-vl`, a small Qwen2.5-VL (the tiny
Llama's decoder size, a tiny vision tower) whose tokenizer adds Qwen's chat
and vision tokens to the bytes (`EMBEDDED_TOKENS`). Both the tokenizer
(which special tokens) and the data layer (how a vision-language model
takes its images, from its config) need these facts before any model is
built, and the model builder (`hp.train.model`) builds from the same
configs, so they live here, below all three. `model_config` gives the HF
config of an embedded model or of a local directory's config.json.
"""

from __future__ import annotations

import os

from hp.train.data.byte_tokenizer import ByteTokenizer

TINY_LLAMA = "hp/tiny-llama"
TINY_QWEN3_MOE = "hp/tiny-qwen3-moe"
TINY_QWEN2_5_VL = "hp/tiny-qwen2.5-vl"
# Qwen's chat tokens (LlamaFactory's qwen2_vl template spells them) and vision tokens, as Qwen2.5-VL's tokenizer has them.
QWEN_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_llama_config(vocab_size: int):
    """The embedded model: 2 layers, hidden 128, vocabulary padded to a multiple of 64 (splits evenly).

    >>> tiny_llama_config(259).vocab_size
    320
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=-(-vocab_size // 64) * 64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, use_cache=False,
        tie_word_embeddings=False,
    )


def tiny_qwen3_moe_config(vocab_size: int):
    """The embedded mixture of experts: tiny Llama's attention (2 layers, hidden 128, 4 heads, 2 key/value
    heads of dim 32), and in every layer 8 experts of width 64, each token routed to 2 (weights renormalised).

    HF adds its auxiliary load-balancing loss (Switch Transformer's) to the loss, weighted 0.01. Every
    width is a multiple of 8, as `torch._grouped_mm` needs on CPU.

    >>> config = tiny_qwen3_moe_config(259)
    >>> config.model_type, config.vocab_size, config.num_experts, config.output_router_logits
    ('qwen3_moe', 320, 8, True)
    """
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=-(-vocab_size // 64) * 64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, use_cache=False,
        tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


def tiny_qwen2_5_vl_config(vocab_size: int):
    """The embedded vision-language model: a Qwen2.5-VL with the tiny Llama's decoder size (2 layers, hidden
    128, 4 heads and 2 key/value heads of dim 32; M-RoPE sections 4, 6, 6 of the 16 rotary frequencies) and a
    tiny vision tower (2 blocks, hidden 64, 2 heads, 4-pixel patches merged 2 x 2, 2 frames a patch; windows of
    4 x 4 merged tokens, the last block attending the whole image, as Qwen2.5-VL's do).

    Its tokens are the byte tokenizer's and `QWEN_VL_TOKENS` after them (`vision_start_token_id`,
    `vision_end_token_id` and `image_token_id` are theirs); `vocab_size` (the tokenizer's) is padded to a
    multiple of 64.

    >>> config = tiny_qwen2_5_vl_config(265)
    >>> config.model_type, config.text_config.vocab_size, config.image_token_id, config.vision_config.patch_size
    ('qwen2_5_vl', 320, 263, 4)
    """
    from transformers import Qwen2_5_VLConfig

    tokenizer = ByteTokenizer(QWEN_VL_TOKENS)
    start, end, image, video = (tokenizer.encode(token)[0] for token in QWEN_VL_TOKENS[2:])
    text = {"vocab_size": -(-max(vocab_size, tokenizer.vocab_size) // 64) * 64, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "use_cache": False, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.encode("<|im_end|>")[0],  # the chat's eos, as Qwen2.5-VL's config has it
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 128,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 32,
              "fullatt_block_indexes": [1]}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, use_cache=False,
                            vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                            video_token_id=video)


# The embedded models, by name: each built from a config in code, for the byte-level tokenizer.
EMBEDDED = {TINY_LLAMA: tiny_llama_config, TINY_QWEN3_MOE: tiny_qwen3_moe_config,
            TINY_QWEN2_5_VL: tiny_qwen2_5_vl_config}
# The special tokens an embedded model's byte tokenizer adds after its own three (none: bytes alone).
EMBEDDED_TOKENS = {TINY_QWEN2_5_VL: QWEN_VL_TOKENS}


def model_config(name_or_path: str, vocab_size: int):
    """The HF config of `name_or_path` (an embedded model's, or a local directory's config.json)."""
    from transformers import AutoConfig

    if name_or_path in EMBEDDED:
        return EMBEDDED[name_or_path](vocab_size)
    if not os.path.isfile(os.path.join(name_or_path, "config.json")):
        raise FileNotFoundError(
            f"model_name_or_path {name_or_path!r} is neither one of the embedded models ({', '.join(EMBEDDED)}) "
            "nor a local directory with a config.json (hp never downloads: point it to a local HF model directory)"
        )
    config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    config.use_cache = False
    return config

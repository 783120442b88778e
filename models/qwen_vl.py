"""The plans of HF's Qwen vision-language families: Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE.

A model holds a vision tower (`model.visual`: patch embedding, vision
blocks, a patch merger, and for Qwen3-VL deepstack mergers) and a decoder
(`model.language_model`), which is Qwen2's (Qwen2.5-VL: q, k, v biases) or
Qwen3's (q and k norms; Qwen3-VL-MoE: Qwen3-MoE's sparse layers). The
model embeds the text, runs the tower over the images, scatters its output
into the image placeholders and computes M-RoPE's 3-D positions, all on the
whole sequence; the decoder then runs as a dense (or MoE) family's does,
split Megatron's way over tp. The globs are anchored at
`model.language_model`: the vision tower's own `mlp.*_proj` (Qwen2.5-VL)
must not match, since the tower is replicated over the decoder's ranks
unless the strategy splits it too (`vision_tp`, by `VISION_TP_PLAN`).
"""

from __future__ import annotations

from hp.parallel.model_plan import ModelPlan

DECODER = "model.language_model"
_LAYERS = f"{DECODER}.layers.*"
TP_PLAN = {
    f"{_LAYERS}.self_attn.[qkv]_proj.weight": "out/tp in",
    f"{_LAYERS}.self_attn.[qkv]_proj.bias": "out/tp",
    f"{_LAYERS}.self_attn.o_proj.weight": "out in/tp",
    f"{_LAYERS}.mlp.gate_proj.weight": "out/tp in",
    f"{_LAYERS}.mlp.up_proj.weight": "out/tp in",
    f"{_LAYERS}.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}
# The vision tower over tp (`Strategy.vision_tp`): its fused q, k, v split by heads, its MLP Megatron's way
# (Qwen2.5-VL's gated gate/up/down, Qwen3-VL's linear_fc1/fc2); the patch embedding and mergers stay whole.
_BLOCKS = "model.visual.blocks.*"
VISION_TP_PLAN = {
    f"{_BLOCKS}.attn.qkv.weight": "[q k v]/tp in",
    f"{_BLOCKS}.attn.qkv.bias": "[q k v]/tp",
    f"{_BLOCKS}.attn.proj.weight": "out in/tp",
    f"{_BLOCKS}.mlp.gate_proj.weight": "out/tp in",
    f"{_BLOCKS}.mlp.gate_proj.bias": "out/tp",
    f"{_BLOCKS}.mlp.up_proj.weight": "out/tp in",
    f"{_BLOCKS}.mlp.up_proj.bias": "out/tp",
    f"{_BLOCKS}.mlp.down_proj.weight": "out in/tp",
    f"{_BLOCKS}.mlp.linear_fc1.weight": "out/tp in",
    f"{_BLOCKS}.mlp.linear_fc1.bias": "out/tp",
    f"{_BLOCKS}.mlp.linear_fc2.weight": "out in/tp",
}
VISION_RESIDUAL = (f"{_BLOCKS}.attn.proj", f"{_BLOCKS}.mlp.down_proj", f"{_BLOCKS}.mlp.linear_fc2")
_NAMES = dict(vision_params=VISION_TP_PLAN, vision_residual=VISION_RESIDUAL,
              projector=("model.visual.merger", "model.visual.deepstack_merger_list"), blocks=f"{DECODER}.layers", embedding=f"{DECODER}.embed_tokens", norm=f"{DECODER}.norm", rotary=f"{DECODER}.rotary_emb",
              vision="model.visual", decoder=DECODER)

PLAN = ModelPlan(params=TP_PLAN, residual=(f"{_LAYERS}.self_attn.o_proj", f"{_LAYERS}.mlp.down_proj"), **_NAMES)
MOE_PLAN = ModelPlan(
    params=TP_PLAN, residual=(f"{_LAYERS}.self_attn.o_proj", f"{_LAYERS}.mlp"),
    experts=(f"{_LAYERS}.mlp.experts",),
    expert_params={f"{_LAYERS}.mlp.experts.gate_up_proj": "e/ep h i", f"{_LAYERS}.mlp.experts.down_proj": "e/ep i h"},
    routers=(f"{_LAYERS}.mlp.gate",), **_NAMES,
)
MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
MOE_MODEL_TYPES = ("qwen3_vl_moe",)

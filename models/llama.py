"""The plan of Llama-style HF families: Llama, Mistral, Qwen2, Qwen3, Gemma-2 and Gemma-3 (text).

They share module names: `q_proj`, `k_proj`, `v_proj`, `o_proj` under
`self_attn`, `gate_proj`, `up_proj`, `down_proj` under `mlp`, the decoder
blocks in `model.layers`, the embedding `model.embed_tokens`, RoPE in
`model.rotary_emb` and the head `lm_head`. Tensor parallel is Megatron's:
q, k, v, gate and up split by output features, o and down by input
features, the LM head by vocabulary (so the loss runs vocab-parallel). The
outputs of o and down join the residual stream, so their pending sums are
reduced there: that is also what keeps Gemma's sandwich norms (a norm
between the projection and the residual add) at two all-reduces per layer.
Gemma ties the LM head to the embedding: laying out `lm_head.weight` lays
out the shared parameter once, and the embedding runs vocab-parallel.
Qwen2's q, k, v biases split with their weights.
"""

from __future__ import annotations

from hp.parallel import tp_plan
from hp.parallel.model_plan import ModelPlan

# Layouts of nn.Linear weights, which are stored (out, in).
TP_PLAN = {
    "*.self_attn.[qkv]_proj.weight": "out/tp in",
    "*.mlp.gate_proj.weight": "out/tp in",
    "*.mlp.up_proj.weight": "out/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}
BIAS_PLAN = {"*.self_attn.[qkv]_proj.bias": "out/tp"}  # Qwen2 has q/k/v biases

PLAN = ModelPlan(params={**TP_PLAN, **BIAS_PLAN}, residual=("*.self_attn.o_proj", "*.mlp.down_proj"))
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")


def choice_layouts(choice: tp_plan.Choice) -> tuple[dict[str, str], dict[str, str]]:
    """(parameter plan, module output layouts) realising a `hp.tp_plan.choose` result.

    >>> params, outputs = choice_layouts(tp_plan.choose(tp_plan.square(4096), 8192, 8, schemes=("1d", "2d")))
    >>> params["*.self_attn.o_proj.weight"], outputs
    ('out/x in/y', {'model.embed_tokens': 'b/y s h/x'})
    """
    if choice.scheme == "1d":
        return dict(TP_PLAN), {}
    if choice.scheme == "summa":  # every weight alike: out over y, in over x
        return {
            "*.self_attn.[qkvo]_proj.weight": "out/y in/x", "*.mlp.*_proj.weight": "out/y in/x",
            "lm_head.weight": "vocab/y h/x",
        }, {"model.embed_tokens": "b/x s h/y"}
    tokens = "b/z/y" if choice.scheme == "3d" else "b/y"  # 2D: linears alternate orientation
    return {
        "*.self_attn.[qkv]_proj.weight": "out/y in/x", "*.mlp.gate_proj.weight": "out/y in/x",
        "*.mlp.up_proj.weight": "out/y in/x", "*.self_attn.o_proj.weight": "out/x in/y",
        "*.mlp.down_proj.weight": "out/x in/y", "lm_head.weight": "vocab/y h/x",
    }, {"model.embed_tokens": f"{tokens} s h/x"}

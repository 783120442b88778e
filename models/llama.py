"""Llama's Megatron layouts written out, and the 2D / SUMMA / 3D layouts of `hp.tp_plan`.

The zoo derives every family's plan from transformers' own (`hp.models.derive`);
the Llama-style families (Llama, Mistral, Qwen2/3, Gemma-2/3) derive the
layouts below. They are written out here for what the derivation does not
cover: laying a Llama out by hand with `hp.parallelize` (the examples), and
turning a choice of `hp.tp_plan.choose` into layouts over two or three mesh
axes (`choice_layouts`). q, k, v, gate and up split by output features, o and
down by input features, the LM head by vocabulary (so the loss runs
vocab-parallel).
"""

from __future__ import annotations

from hp.parallel import tp_plan

# Layouts of nn.Linear weights, which are stored (out, in).
TP_PLAN = {
    "*.self_attn.[qkv]_proj.weight": "out/tp in",
    "*.mlp.gate_proj.weight": "out/tp in",
    "*.mlp.up_proj.weight": "out/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}


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

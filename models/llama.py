"""Llama's Megatron layouts written out, and the 2D / SUMMA / 3D layouts of `hp.tp_plan`.

The zoo derives every family's plan from transformers' own (`hp.models.derive`);
the Llama-style families (Llama, Mistral, Qwen2/3, Gemma-2/3) derive the
layouts below. They are written out here for what the derivation does not
cover: laying a Llama out by hand with `hp.parallelize` (the examples), and
turning a choice of `hp.tp_plan.choose` into layouts over two or three mesh
axes (`choice_layouts`, by the translation `hp.Strategy(tp2d=...)` applies). q, k, v, gate and up split by output features, o and
down by input features, the LM head by vocabulary (so the loss runs
vocab-parallel).
"""

from __future__ import annotations

from hp.parallel import tp_plan
from hp.parallel.tp2d import TP2D

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
    """(parameter plan, module output layouts) realising a `hp.tp_plan.choose` result, as `hp.parallel.tp2d`
    translates any family's plan.

    >>> params, outputs = choice_layouts(tp_plan.choose(tp_plan.square(4096), 8192, 8, schemes=("1d", "2d")))
    >>> params["*.self_attn.o_proj.weight"], outputs
    ('out/x in/y', {'model.embed_tokens': 'b/y s h/x'})
    """
    if choice.scheme == "1d":
        return dict(TP_PLAN), {}
    two_d = TP2D(scheme=choice.scheme, **choice.mesh)
    return {k: two_d.param_layout(v) for k, v in TP_PLAN.items()}, {"model.embed_tokens": two_d.stream("b", "s")}

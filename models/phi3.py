"""The plan of HF Phi-3: fused projections, each part split over tp.

Phi-3 packs q, k and v into one `qkv_proj` and gate and up into one
`gate_up_proj`, and slices their outputs in its code. Megatron splits each
part over tp (rank r holds q_r, k_r, v_r), so attention and the MLP run on
local heads and features without communication: the fused layouts
`[q k v]/tp` and `[gate up]/tp` say exactly that. Fused parts must be equal
(DTensor has a placement only for those): q, k and v need as many key/value
heads as query heads, as in Phi-3-mini.
"""

from __future__ import annotations

from hp.parallel.model_plan import ModelPlan

TP_PLAN = {
    "*.self_attn.qkv_proj.weight": "[q k v]/tp in",
    "*.mlp.gate_up_proj.weight": "[gate up]/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}

PLAN = ModelPlan(params=TP_PLAN, residual=("*.self_attn.o_proj", "*.mlp.down_proj"))
MODEL_TYPES = ("phi3",)

"""The plan of HF's Qwen mixture-of-experts families: Qwen2-MoE and Qwen3-MoE.

Attention is Llama's (Qwen2-MoE keeps Qwen2's q, k, v biases), and so is
tensor parallel over it. A sparse layer's `mlp` routes each token to top-k
of E experts whose weights are packed in `experts.gate_up_proj [E, 2I, H]`
and `experts.down_proj [E, H, I]`; dense layers (`mlp_only_layers`,
`decoder_sparse_step`) keep a plain MLP, split Megatron's way. Expert
parallel splits the packed experts along E over `ep` and sends each token
to the ranks of its experts (`hp.ops.expert_parallel`); the experts are not
split over tp, whose ranks hold the same tokens. The router (`mlp.gate`)
is replicated; its softmax top-k takes the strategy's routing bias
(`hp.parallel.expert_balance`). Qwen2-MoE adds a shared expert, a plain MLP split over tp
like the dense ones, behind a sigmoid gate. The whole `mlp` output joins the
residual stream, so the dense MLP's and the shared expert's pending sums are
reduced there.
"""

from __future__ import annotations

from hp.parallel.model_plan import ModelPlan
from hp.models.llama import BIAS_PLAN

TP_PLAN = {
    "*.self_attn.[qkv]_proj.weight": "out/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.gate_proj.weight": "out/tp in",
    "*.mlp.up_proj.weight": "out/tp in",
    "*.mlp.down_proj.weight": "out in/tp",
    "*.mlp.shared_expert.gate_proj.weight": "out/tp in",
    "*.mlp.shared_expert.up_proj.weight": "out/tp in",
    "*.mlp.shared_expert.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}
EXPERT_PLAN = {"*.mlp.experts.gate_up_proj": "e/ep i h", "*.mlp.experts.down_proj": "e/ep h i"}

PLAN = ModelPlan(params={**TP_PLAN, **BIAS_PLAN}, residual=("*.self_attn.o_proj", "*.mlp"),
                 experts=("*.mlp.experts",), expert_params=EXPERT_PLAN, routers=("*.mlp.gate",))
MODEL_TYPES = ("qwen2_moe", "qwen3_moe")

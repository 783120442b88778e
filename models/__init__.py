"""hp.models: the reference model zoo, one plan per HF model family.

`plan_for(config)` picks the plan of an HF config's `model_type`;
`hp.apply_strategy(model, mesh, strategy, plan)` applies any strategy with
it. A plan is data (`hp.ModelPlan`): parameter layouts and module names.
The zoo may import hp's lower layers (`hp.parallel`, `hp.ops`, `hp.layouts`),
never `hp.train` or the CLI.

>>> from hp.models import plan_for_type, supported
>>> plan_for_type("mistral").residual
('*.self_attn.o_proj', '*.mlp.down_proj')
>>> "phi3" in supported()
True
"""

from __future__ import annotations

from typing import Any

from hp.parallel.model_plan import ModelPlan
from hp.models import llama, phi3, qwen_moe, qwen_vl
from hp.models.tiny import FAMILIES, MOE_FAMILIES, VL_FAMILIES, tiny_config, tiny_vl_batch

__all__ = ["FAMILIES", "MOE_FAMILIES", "VL_FAMILIES", "plan_for", "plan_for_type", "supported", "tiny_config",
           "tiny_vl_batch"]

_PLANS: dict[str, ModelPlan] = {
    **{t: llama.PLAN for t in llama.MODEL_TYPES},
    **{t: phi3.PLAN for t in phi3.MODEL_TYPES},
    **{t: qwen_moe.PLAN for t in qwen_moe.MODEL_TYPES},
    **{t: qwen_vl.PLAN for t in qwen_vl.MODEL_TYPES},
    **{t: qwen_vl.MOE_PLAN for t in qwen_vl.MOE_MODEL_TYPES},
}


def supported() -> tuple[str, ...]:
    """The HF `model_type`s the zoo has a plan for."""
    return tuple(_PLANS)


def plan_for_type(model_type: str) -> ModelPlan:
    """The plan of an HF `model_type`; a ValueError naming the supported ones otherwise."""
    plan = _PLANS.get(model_type)
    if plan is None:
        raise ValueError(f"no model plan for model_type {model_type!r}; hp.models has plans for "
                         f"{', '.join(supported())}")
    return plan


def plan_for(config: Any) -> ModelPlan:
    """The plan of an HF config (by its `model_type`)."""
    return plan_for_type(config.model_type)

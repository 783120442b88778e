"""hp.models: the reference model zoo, a plan for every family transformers can split.

`plan_for(config)` derives a family's `hp.ModelPlan` from the tensor-,
expert- and pipeline-parallel plans that transformers ships with the model
(`hp.models.derive`); the vision-language families keep hand-written plans
(`hp.models.qwen_vl`: the derivation reads causal LMs, and their vision tower
and decoder input are hp's own). A family with layers hp cannot split
(`hp.models.unsplit`) gets a plan that runs under dp and FSDP only.
`hp.apply_strategy(model, mesh, strategy, plan)` applies any strategy with
it. The zoo may import hp's lower layers (`hp.parallel`, `hp.ops`,
`hp.layouts`), never `hp.train` or the CLI.

>>> from hp.models import plan_for_type
>>> plan_for_type("mistral").residual
('*.self_attn.o_proj', '*.mlp.down_proj')
>>> plan_for_type("gpt_neox").blocks
'gpt_neox.layers'
"""

from __future__ import annotations

import functools
from typing import Any

from hp.parallel.model_plan import ModelPlan
from hp.models import qwen_vl
from hp.models.derive import derive
from hp.models.tiny import DERIVED_FAMILIES, FAMILIES, MOE_FAMILIES, VL_FAMILIES, tiny_config, tiny_vl_batch

__all__ = ["DERIVED_FAMILIES", "FAMILIES", "MOE_FAMILIES", "VL_FAMILIES", "plan_for", "plan_for_type", "supported", "tiny_config",
           "tiny_vl_batch"]

_HAND: dict[str, ModelPlan] = {
    **{t: qwen_vl.PLAN for t in qwen_vl.MODEL_TYPES},
    **{t: qwen_vl.MOE_PLAN for t in qwen_vl.MOE_MODEL_TYPES},
}


@functools.cache
def supported() -> tuple[str, ...]:
    """The HF `model_type`s with a plan: every causal LM with a tensor- or pipeline-parallel plan, and the
    hand-planned ones."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted({*(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if _has_plan(t)), *_HAND}))


def _has_plan(model_type: str) -> bool:
    """Whether `model_type` is in `supported()`, importing its config module alone (all of them take seconds)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in _HAND:
        return True
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in transformers.CONFIG_MAPPING:
        return False
    config = transformers.CONFIG_MAPPING[model_type]
    return any(getattr(config, f"base_model_{kind}_plan", None) for kind in ("pp", "tp"))


def plan_for_type(model_type: str) -> ModelPlan:
    """The plan of an HF `model_type`, derived on its tiny config; a ValueError naming the supported ones otherwise."""
    if model_type in _HAND:
        return _HAND[model_type]
    _check_supported(model_type)  # before its tiny config, which needs the type known
    config = tiny_config(model_type, layers=1)
    return _derived(type(config), config.to_json_string(use_diff=False))


def plan_for(config: Any) -> ModelPlan:
    """The plan of an HF config: hand-written for the vision-language families, derived for the others."""
    if config.model_type in _HAND:
        return _HAND[config.model_type]
    _check_supported(config.model_type)
    return _derived(type(config), config.to_json_string(use_diff=False))


def _check_supported(model_type: str) -> None:
    if not _has_plan(model_type):
        raise ValueError(f"no model plan for model_type {model_type!r}: hp derives plans for the causal LMs "
                         f"whose transformers model carries a tensor- or pipeline-parallel plan; those are {', '.join(supported())}")


@functools.lru_cache(maxsize=64)
def _derived(config_class: type, config_json: str) -> ModelPlan:
    import json

    config = config_class.from_dict(json.loads(config_json))  # the cache's key: configs are not hashable
    try:
        return derive(config)
    except (ValueError, KeyError) as error:
        raise ValueError(f"no model plan for model_type {config.model_type!r}: {error}") from None

"""LoRA adapters on a model's linears, laid out with their base weights.

A LoRA linear computes `W x + s B A dropout(x)`, with A (`rank x in`) and B
(`out x rank`) the only weights that train and `s = alpha / rank` (or
`alpha / sqrt(rank)`, rsLoRA). `add_lora` gives each targeted `nn.Linear`
two children, `lora_A` and `lora_B`, and a forward hook that adds their
product to the linear's output; base weights keep their names, so a plan's
layouts, checkpoints and HF's files still name them.

The adapters are laid out from their base weight's layout
(`adapter_layouts`), so a LoRA layer adds no collective on the activation
path: A takes the base's input dim as the base does (whole for a
column-parallel base, split for a row-parallel one) and B its output dim.
Under a column-parallel base, A's output is whole and B's block is the
base's output block; under a row-parallel base, A's output is a pending sum
that B keeps pending, and it joins the base's pending sum before the one
reduction of the residual stream. What remains is adapter-sized: the
gradient of A's output under a column-parallel base, and A's output
gathered under sequence parallel.

>>> import hp, torch
>>> from hp.models import tiny_config
>>> from transformers import AutoModelForCausalLM
>>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
>>> adapted = hp.add_lora(model, hp.Lora(rank=4, targets=("q_proj", "v_proj")))
>>> adapted
['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']
>>> [n for n, p in model.named_parameters() if p.requires_grad]  # doctest: +NORMALIZE_WHITESPACE
['model.layers.0.self_attn.q_proj.lora_A.weight', 'model.layers.0.self_attn.q_proj.lora_B.weight',
 'model.layers.0.self_attn.v_proj.lora_A.weight', 'model.layers.0.self_attn.v_proj.lora_B.weight']
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
from torch import nn

from hp.finetune import Lora, LoraError
from hp.layouts import layout

__all__ = ["Lora", "LoraError", "adapter_layouts", "add_lora", "has_lora", "is_adapter"]


def add_lora(model: nn.Module, lora: Lora, *, blocks: str = "model.layers") -> list[str]:
    """Give the linears `lora` targets adapters, freeze every other weight; the adapted modules' names.

    Call it before `hp.apply_strategy`, which lays the adapters out with their base weights
    (the hook that adds them then runs before the strategy's hooks on the same module). A is
    initialised as `nn.Linear` initialises a weight (Kaiming-uniform), B with zeros, so the model
    computes what it did until B trains. `blocks` is where `("all",)` looks (the plan's
    `ModelPlan.blocks`).
    """
    adapted = [name for name, module in model.named_modules() if _targeted(name, module, lora, blocks)]
    if not adapted:
        raise LoraError(f"lora targets = {lora.targets!r} match no nn.Linear of {type(model).__name__}")
    for param in model.parameters():
        param.requires_grad_(False)
    for name in adapted:
        _adapt(model.get_submodule(name), lora)
    extra = [name for name, _ in model.named_modules() if name and name.rsplit(".", 1)[-1] in lora.extra]
    missing = set(lora.extra) - {name.rsplit(".", 1)[-1] for name in extra}
    if missing:
        raise LoraError(f"lora extra modules {sorted(missing)} match no module of {type(model).__name__}")
    for name in extra:
        for param in model.get_submodule(name).parameters():
            param.requires_grad_(True)
    return adapted


def adapter_layouts(params: Mapping[str, str]) -> dict[str, str]:
    """The layouts of LoRA weights that follow each base weight of a parameter plan.

    >>> adapter_layouts({"*.q_proj.weight": "out/tp in", "*.o_proj.weight": "out in/tp"})
    {'*.q_proj.lora_A.weight': 'r in', '*.q_proj.lora_B.weight': 'out/tp r', \
'*.o_proj.lora_A.weight': 'r in/tp', '*.o_proj.lora_B.weight': 'out r'}
    """
    derived = {}
    for glob, spec in params.items():
        if not glob.endswith(".weight"):
            continue
        dims = [str(d) for d in layout(spec).dims]
        if len(dims) != 2:
            continue
        base = glob[: -len(".weight")]
        derived[f"{base}.lora_A.weight"] = f"r {dims[1]}"
        derived[f"{base}.lora_B.weight"] = f"{dims[0]} r"
    return derived


def has_lora(model: nn.Module) -> bool:
    """Whether `add_lora` gave `model` adapters."""
    return any(hasattr(m, "lora_A") for m in model.modules())


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA weight's (`...q_proj.lora_A.weight`).

    >>> is_adapter("model.layers.0.self_attn.q_proj.lora_B.weight"), is_adapter("lm_head.weight")
    (True, False)
    """
    return ".lora_A." in name or ".lora_B." in name


def _targeted(name: str, module: nn.Module, lora: Lora, blocks: str) -> bool:
    if not isinstance(module, nn.Linear) or hasattr(module, "lora_A"):
        return False
    if lora.targets == ("all",):
        return fnmatch.fnmatchcase(name, f"{blocks}.*")
    return name.rsplit(".", 1)[-1] in lora.targets


def _adapt(linear: nn.Linear, lora: Lora) -> None:
    like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
    linear.lora_A = nn.Linear(linear.in_features, lora.rank, bias=False, **like)
    linear.lora_B = nn.Linear(lora.rank, linear.out_features, bias=False, **like)
    if linear.weight.device.type != "meta":
        nn.init.zeros_(linear.lora_B.weight)
    linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
    linear.lora_scale = lora.scale
    linear.register_forward_hook(_add_adapter)


def _add_adapter(linear: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out + linear.lora_B(linear.lora_A(linear.lora_dropout(args[0]))) * linear.lora_scale

"""Which weights train: LlamaFactory's finetuning types (full, lora, freeze) on an HF model.

`full` trains every weight. `lora` trains adapters (`hp.add_lora`) on the
linears `lora_target` names and the modules `additional_target` names.
`freeze` trains some decoder blocks in full: the last
`freeze_trainable_layers` (the first ones when negative), within them only
the modules `freeze_trainable_modules` names (or all), plus the modules
outside the blocks `freeze_extra_modules` names (the embedding, the final
norm). Both are applied before the strategy lays the model out, so FSDP
groups and the adapters' layouts see the final model.
"""

from __future__ import annotations

from torch import nn

from hp.finetune import Finetuning, Freeze, FreezeError
from hp.lora import add_lora

__all__ = ["Finetuning", "Freeze", "FreezeError", "apply_finetuning"]


def apply_finetuning(model: nn.Module, finetuning: Finetuning, blocks: str) -> None:
    """Add adapters or freeze weights as `finetuning` says (`blocks`: the plan's decoder blocks).

    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=3))
    >>> apply_finetuning(model, Finetuning(freeze=Freeze(1, ("mlp",), ("norm",))), "model.layers")
    >>> sorted({n.split(".weight")[0] for n, p in model.named_parameters() if p.requires_grad})
    ['model.layers.2.mlp.down_proj', 'model.layers.2.mlp.gate_proj', 'model.layers.2.mlp.up_proj', 'model.norm']
    """
    if finetuning.lora is not None:
        add_lora(model, finetuning.lora, blocks=blocks)
    if finetuning.freeze is not None:
        _freeze(model, finetuning.freeze, blocks)


def _freeze(model: nn.Module, freeze: Freeze, blocks: str) -> None:
    layers = model.get_submodule(blocks)
    count = len(layers)
    if abs(freeze.trainable_layers) > count:
        raise FreezeError(f"freeze_trainable_layers = {freeze.trainable_layers}: {type(model).__name__} has {count} "
                          f"decoder layers; expected at most {count} either way")
    chosen = range(count - freeze.trainable_layers, count) if freeze.trainable_layers > 0 else range(-freeze.trainable_layers)
    for param in model.parameters():
        param.requires_grad_(False)
    every = freeze.trainable_modules == ("all",)
    found = set()
    for i in chosen:
        for name, param in layers[i].named_parameters():
            module = name.split(".")[0]
            if every or module in freeze.trainable_modules:
                param.requires_grad_(True)
                found.add(module)
    missing = set(freeze.trainable_modules) - found - {"all"}
    if missing:
        raise FreezeError(f"freeze_trainable_modules {sorted(missing)} name no module of {type(layers[0]).__name__} "
                          f"(it has {', '.join(sorted({n.split('.')[0] for n, _ in layers[0].named_parameters()}))})")
    outside = {name: module for name, module in model.named_modules() if name and not name.startswith(blocks)}
    for extra in freeze.extra_modules:
        matched = [m for name, m in outside.items() if name.rsplit(".", 1)[-1] == extra]
        if not matched:
            raise FreezeError(f"freeze_extra_modules names {extra!r}, which is no module outside the decoder layers "
                              f"of {type(model).__name__}")
        for module in matched:
            for param in module.parameters():
                param.requires_grad_(True)

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

from hp.parallel.finetune import Finetuning, Freeze, FreezeError
from hp.parallel.lora import add_lora

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
    """Every weight frozen but those `freeze` names; a name that matches nothing is refused first."""
    trained = _trained_by(model, freeze, blocks)
    for param in model.parameters():
        param.requires_grad_(False)
    for param in trained:
        param.requires_grad_(True)


def _trained_by(model: nn.Module, freeze: Freeze, blocks: str) -> list[nn.Parameter]:
    layers = model.get_submodule(blocks)
    count = len(layers)
    if abs(freeze.trainable_layers) > count:
        raise FreezeError(f"freeze_trainable_layers = {freeze.trainable_layers}: {type(model).__name__} has {count} "
                          f"decoder layers; expected at most {count} either way")
    n = freeze.trainable_layers
    chosen = range(count - n, count) if n > 0 else range(-n)
    every = freeze.trainable_modules == ("all",)
    have = {name.split(".")[0] for name, _ in layers[0].named_parameters()}
    missing = set(freeze.trainable_modules) - have - {"all"}
    if missing:
        raise FreezeError(f"freeze_trainable_modules {sorted(missing)} name no module of {type(layers[0]).__name__} "
                          f"(it has {', '.join(sorted(have))})")
    trained = [param for i in chosen for name, param in layers[i].named_parameters()
               if every or name.split(".")[0] in freeze.trainable_modules]
    outside = {name: module for name, module in model.named_modules() if name and not name.startswith(blocks)}
    for extra in freeze.extra_modules:
        matched = [m for name, m in outside.items() if name.rsplit(".", 1)[-1] == extra]
        if not matched:
            raise FreezeError(f"freeze_extra_modules names {extra!r}, which is no module outside the decoder layers "
                              f"of {type(model).__name__}")
        trained += [param for module in matched for param in module.parameters()]
    return trained

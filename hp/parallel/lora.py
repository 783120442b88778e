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

import copy
import fnmatch
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from hp.parallel.finetune import Lora, LoraError
from hp.layouts import layout
from hp.ops.local import copy_whole

__all__ = ["Lora", "LoraError", "adapter_layouts", "adapters_off", "add_lora", "from_peft_config", "has_lora",
           "is_adapter", "merge_lora", "peft_config", "peft_state", "start_adapters"]


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
    extra = [name for name, _ in model.named_modules() if name and name.rsplit(".", 1)[-1] in lora.extra]
    missing = set(lora.extra) - {name.rsplit(".", 1)[-1] for name in extra}
    if missing:  # checked before anything changes: a refused call leaves the model as it was
        raise LoraError(f"lora extra modules {sorted(missing)} match no module of {type(model).__name__}")
    for param in model.parameters():
        param.requires_grad_(False)
    for name in adapted:
        _adapt(model.get_submodule(name), lora)
    for name in extra:
        for param in model.get_submodule(name).parameters():
            param.requires_grad_(True)
    model.hp_lora = (lora, tuple(adapted), tuple(extra))
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


def peft_config(model: nn.Module, base: str | None = None) -> dict:
    """PEFT's `adapter_config.json` for `model`'s adapters (`peft.PeftModel.from_pretrained` reads it).

    The targets are the adapted modules' full names (PEFT matches a listed name whole or as a
    suffix), so the file names exactly the modules that carry adapters; `base` is the base model's
    directory or name, where PEFT looks for it by default.
    """
    lora, adapted, _ = model.hp_lora
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha if lora.alpha is not None else 2 * lora.rank, "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora, "target_modules": list(adapted), "modules_to_save": list(lora.extra) or None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
    }


def from_peft_config(config: dict) -> Lora:
    """The `Lora` that `peft_config` wrote (its targets: the adapted modules' names).

    >>> from_peft_config({"r": 4, "lora_alpha": 8, "target_modules": ["model.layers.0.mlp.up_proj"]}).scale
    2.0
    """
    return Lora(rank=config["r"], alpha=config.get("lora_alpha"), dropout=config.get("lora_dropout", 0.0),
                targets=tuple(config["target_modules"]), rslora=config.get("use_rslora", False),
                extra=tuple(config.get("modules_to_save") or ()))


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights PEFT's `adapter_model.safetensors` holds: adapters and the modules trained in full,
    under PEFT's names (`base_model.model.` and the module's name)."""
    _, _, extra = model.hp_lora
    kept = {k: v for k, v in model.state_dict().items() if is_adapter(k) or k.startswith(tuple(f"{m}." for m in extra))}
    return {f"base_model.model.{k}": v.detach().contiguous() for k, v in kept.items()}


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing as its base while inside: every adapter is skipped (PEFT's `disable_adapter`).

    Preference training reads its reference model so under LoRA: the base weights never change.

    >>> import torch
    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> base = model(input_ids=ids).logits
    >>> _ = add_lora(model, Lora(rank=2)); _ = [torch.nn.init.ones_(m.lora_B.weight) for m in model.modules()
    ...                                           if hasattr(m, "lora_B")]
    >>> with adapters_off(model):
    ...     torch.equal(model(input_ids=ids).logits, base)
    True
    """
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    for module in adapted:
        module.lora_off = True
    try:
        yield model
    finally:
        for module in adapted:
            module.lora_off = False


def base_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of `model` computing as its base for good (every adapter skipped, as inside
    `adapters_off`): a preference stage's reference where the policy and its reference cannot share one
    module (they run as programs of their own, `hp.mpmd.reference`).

    >>> from hp.models import tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> _ = add_lora(model, Lora(rank=2))
    >>> frozen = base_copy(model)
    >>> all(m.lora_off for m in frozen.modules() if hasattr(m, "lora_A")), any(p.requires_grad for p in frozen.parameters())
    (True, False)
    """
    frozen = copy.deepcopy(model).requires_grad_(False)
    for module in frozen.modules():
        if hasattr(module, "lora_A"):
            module.lora_off = True
    return frozen


def merge_lora(model: nn.Module) -> None:
    """Fold each adapter into its base weight (W + s B A) and remove it: a plain HF model again."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            with torch.no_grad():
                delta = module.lora_B.weight @ module.lora_A.weight
                module.weight += module.lora_scale * delta.to(module.weight.dtype)
            module.hp_lora_hook.remove()
            for name in ("lora_A", "lora_B", "lora_dropout"):
                delattr(module, name)
            del module.lora_scale, module.hp_lora_hook
    if hasattr(model, "hp_lora"):
        del model.hp_lora


def start_adapters(model: nn.Module, seed: int) -> None:
    """Draw the adapters again as `add_lora` starts them (A as `nn.Linear` draws a weight, B zeros),
    from `seed`: the same on every rank and under every layout, each rank keeping its block of the
    whole draw. For adapters whose storage was made empty (a model built on the meta device)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        whole = torch.zeros(param.shape, dtype=param.dtype)
        if ".lora_A." in name:
            bound = 1 / math.sqrt(param.shape[1])  # nn.Linear's Kaiming-uniform bound
            whole.uniform_(-bound, bound, generator=generator)
        copy_whole(param, whole)


def _targeted(name: str, module: nn.Module, lora: Lora, blocks: str) -> bool:
    """An `nn.Linear` that `lora` names: by its full name or its last part, or any of the blocks' for "all"."""
    if not isinstance(module, nn.Linear) or hasattr(module, "lora_A"):
        return False
    if lora.targets == ("all",):
        return fnmatch.fnmatchcase(name, f"{blocks}.*")
    return name in lora.targets or name.rsplit(".", 1)[-1] in lora.targets


def _adapt(linear: nn.Linear, lora: Lora) -> None:
    like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
    linear.lora_A = nn.Linear(linear.in_features, lora.rank, bias=False, **like)
    linear.lora_B = nn.Linear(lora.rank, linear.out_features, bias=False, **like)
    if linear.weight.device.type != "meta":
        nn.init.zeros_(linear.lora_B.weight)
    linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
    linear.lora_scale = lora.scale
    linear.hp_lora_hook = linear.register_forward_hook(_add_adapter)


def _add_adapter(linear: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    if getattr(linear, "lora_off", False):  # inside adapters_off
        return out
    return out + linear.lora_B(linear.lora_A(linear.lora_dropout(args[0]))) * linear.lora_scale

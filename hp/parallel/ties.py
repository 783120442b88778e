"""Tied parameters: one tensor under several names (an LM head sharing its embedding), kept one.

Why: `nn.Module.to_empty` (like `.to` across devices) replaces each module's
parameters one module at a time, so two modules that held one parameter
come back holding two. A checkpoint stores a tied weight once, under the
name it shares, so loading fills one of the two and leaves the other as
`torch.empty` left it: a model built on the meta device and then loaded
would train with a head that is not the checkpoint's. `to_empty` here
records which names share a parameter and ties them again afterwards, as
HF's `from_pretrained` ties them after loading. `names_by_parameter` is the
one place that says which names are one tensor; `hp.parallelize` lays such
a group out once. A model cut into pipeline stages (`hp.parallel.pipeline`,
`hp.mpmd`'s placed programs) holds a head tied to its embedding twice,
once in its first stage and once in its last (`ties_head`).
"""

from __future__ import annotations

import torch
from torch import nn


def names_by_parameter(module: nn.Module) -> list[list[str]]:
    """Every name of each of `module`'s parameters, one list per parameter, in `named_parameters` order.

    >>> names_by_parameter(torch.nn.Linear(2, 2))
    [['weight'], ['bias']]
    """
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return list(by_id.values())


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The names of each parameter that `module` holds under more than one name, first name first.

    >>> emb = torch.nn.Embedding(8, 4)
    >>> model = torch.nn.ModuleDict({"embed": emb, "head": torch.nn.Linear(4, 8, bias=False)})
    >>> model["head"].weight = emb.weight
    >>> tied_groups(model)
    [['embed.weight', 'head.weight']]
    """
    return [names for names in names_by_parameter(module) if len(names) > 1]


def to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`, with the parameters that were tied still tied.

    >>> with torch.device("meta"):
    ...     model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(8, 4), "head": torch.nn.Linear(4, 8, bias=False)})
    >>> model["head"].weight = model["embed"].weight
    >>> model = to_empty(model, "cpu")
    >>> model["head"].weight is model["embed"].weight, model["head"].weight.device
    (True, device(type='cpu'))
    """
    groups = tied_groups(module)
    module.to_empty(device=device)
    for names in groups:  # every name holds its first name's new parameter
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(names[0]))
    return module


def ties_head(model: nn.Module, plan) -> bool:
    """Whether `model`'s head shares its embedding's weight (HF's `tie_word_embeddings`, the model config's
    own, as transformers reads it for a vision-language model too): cut into pipeline stages, the first and
    the last each hold a copy, whose gradients are summed and whose norm counts once.

    >>> from hp.models import plan_for, tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> config = tiny_config("llama", layers=1, tie_word_embeddings=True)
    >>> ties_head(AutoModelForCausalLM.from_config(config), plan_for(config))
    True
    """
    return bool(getattr(model.config, "tie_word_embeddings", False)) and plan.head is not None


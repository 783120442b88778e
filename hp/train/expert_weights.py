"""A mixture of experts' weights as HF stores them (one expert at a time) and as the model holds them (packed).

transformers keeps the experts packed in memory, `experts.gate_up_proj
[E, 2I, H]` and `experts.down_proj [E, H, I]`, but its checkpoints (and every
model on the Hub) hold them one by one, `experts.{e}.gate_proj.weight [I, H]`,
`experts.{e}.up_proj.weight [I, H]` and `experts.{e}.down_proj.weight [H, I]`
(Mixtral's `w1`, `w3` and `w2`), and it converts on load and on save by the
model's conversion rules (`transformers.conversion_mapping`), whose part
names `parts_of(model)` reads. hp loads weights rank by rank, so the
same conversion happens per block here: each rank reads, from the files,
only the rows of the experts it holds (its ep block, and under FSDP its rows
of those), and copies them into its block of the packed parameter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

# A packed weight's name ends in one of these; its stored experts are these parts, stacked along dim 1.
PARTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
_PACKED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")

Stored = Mapping[str, tuple[tuple[int, ...], str, str]]  # weight name -> (shape, file name, name in the file)


_SOURCE = re.compile(r"experts\.\*\.(\w+)\.weight$")


def parts_of(model) -> dict[str, tuple[str, ...]]:
    """The stored parts of each packed experts weight, by the model's conversion rules (Qwen's names by default).

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from hp.models import tiny_config
    >>> with torch.device("meta"):
    ...     model = AutoModelForCausalLM.from_config(tiny_config("mixtral", layers=1))
    >>> parts_of(model)["experts.gate_up_proj"]
    ('w1', 'w3')
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    parts = dict(PARTS)
    for rule in get_model_conversion_mapping(model):
        if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
            continue
        target = rule.target_patterns[0].rpartition("experts.")[2]
        sources = [_SOURCE.search(p) for p in rule.source_patterns]
        if f"experts.{target}" in PARTS and all(sources):
            parts[f"experts.{target}"] = tuple(m.group(1) for m in sources)
    return parts


def stored_keys(name: str, experts: int, parts: Mapping[str, tuple[str, ...]] = PARTS) -> list[list[str]] | None:
    """[expert][part] -> stored key of packed weight `name`, or None for a weight that is not packed experts.

    >>> stored_keys("model.layers.0.mlp.experts.gate_up_proj", 2)[1]
    ['model.layers.0.mlp.experts.1.gate_proj.weight', 'model.layers.0.mlp.experts.1.up_proj.weight']
    """
    found = _PACKED.match(name)
    if found is None:
        return None
    prefix, packed = found.groups()
    return [[f"{prefix}.{e}.{part}.weight" for part in parts[f"experts.{packed}"]] for e in range(experts)]


def one_by_one(name: str, shape: tuple[int, ...], stored: Stored,
               parts: Mapping[str, tuple[str, ...]] = PARTS) -> list[list[str]] | None:
    """The stored keys of `name` when the files hold its experts one by one (None when they hold it packed).

    A ValueError names the first key that is missing or has the wrong shape.
    """
    if name in stored or len(shape) != 3:
        return None
    keys = stored_keys(name, shape[0], parts)
    if keys is None or keys[0][0] not in stored:
        return None
    part_shape = (shape[1] // len(keys[0]), shape[2])
    for key in (k for parts in keys for k in parts):
        if key not in stored:
            raise ValueError(f"no weight {key!r} in its safetensors, which the packed {name} {list(shape)} needs")
        if stored[key][0] != part_shape:
            raise ValueError(f"weight {key!r} has shape {list(stored[key][0])} in {stored[key][1]}, but the packed "
                             f"{name} {list(shape)} needs {list(part_shape)} per expert")
    return keys


def load(param: torch.Tensor, keys: list[list[str]], stored: Stored, directory: str) -> None:
    """Fill this rank's block of the packed `param` (a DTensor or a plain tensor) from the per-expert files."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        local = param.to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local, offset = param, (0, 0, 0)
    rows = param.shape[1] // len(keys[0])  # of each part
    first, last = offset[1], offset[1] + local.shape[1]
    columns = slice(offset[2], offset[2] + local.shape[2])
    with torch.no_grad():
        for i in range(local.shape[0]):
            for j, key in enumerate(keys[offset[0] + i]):
                start, stop = max(first, j * rows), min(last, (j + 1) * rows)
                if start >= stop:
                    continue
                with safe_open(f"{directory}/{stored[key][1]}", framework="pt") as f:
                    block = f.get_slice(stored[key][2])[start - j * rows:stop - j * rows, columns]
                local[i, start - first:stop - first].copy_(block)

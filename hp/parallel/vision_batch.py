"""Images split with the batch: each rank of dp and ep encodes only its own samples' images.

A vision-language model's batch is laid out `b/dp/ep` at its decoder's input,
where each rank keeps its own samples: the features of the other samples'
images never reach it. So before the model runs its vision tower, each image
is given to its sample (images come in the order of their placeholders: the
k-th image takes the next t*h*w/merge^2 image tokens of the batch), the tower
reads this rank's images only, and the features of the others are zeros of
their sizes, which the decoder's cut drops (their gradient is zero there).
The model then scatters them as it would its own tower's output
(`mm_encoder_outputs`, HF's way of passing features computed elsewhere).

Every rank runs the tower (FSDP gathers it, a tp group splits it): a rank
whose samples hold no image encodes one blank image of the smallest grid
and adds none of it (times zero), so its backward reaches the tower too.

Simulated ranks (one process for them all) cannot read different images: the
model's code turns the grid into Python numbers. They encode the whole
batch's images, which gives the same values.
"""

from __future__ import annotations

import inspect
import itertools

import torch
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hp.parallel.sequence import as_keywords


def split_images(model: nn.Module, mesh, axes: tuple[str, ...]) -> None:
    """Hook the vision-language `model` (the one whose forward takes `pixel_values`) to encode only the
    images of this rank's samples when the batch splits over the mesh `axes` (module docstring)."""
    signature = inspect.signature(model.forward)
    placements = [Shard(0) if name in axes else Replicate() for name in mesh.mesh_dim_names]

    def own_images(mod, args, kwargs):
        kwargs = as_keywords(signature, args, kwargs)
        if kwargs.get("pixel_values") is None or enabled_local_tensor_mode() is not None:
            return (), kwargs
        (count,), (start,) = compute_local_shape_and_global_offset((kwargs["input_ids"].shape[0],), mesh, placements)
        owner = image_owners(kwargs["input_ids"], kwargs["image_grid_thw"], mod.config)
        mine = [k for k, sample in enumerate(owner) if start <= sample < start + count]
        kwargs["mm_encoder_outputs"] = {"image": _features(mod, kwargs.pop("pixel_values"),
                                                           kwargs["image_grid_thw"], mine)}
        return (), kwargs

    model.register_forward_pre_hook(own_images, with_kwargs=True)


def image_owners(input_ids: torch.Tensor, grid: torch.Tensor, config) -> list[int]:
    """The sample each image belongs to: images fill the batch's image tokens in order.

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(image_token_id=9, vision_config=SimpleNamespace(spatial_merge_size=2))
    >>> ids = torch.tensor([[1, 9, 9, 2], [3, 4, 5, 6], [9, 9, 9, 9]])
    >>> image_owners(ids, torch.tensor([[1, 2, 4], [1, 2, 2], [1, 2, 6]]), config)  # 2, 1 and 3 tokens
    [0, 2, 2]
    """
    merge = config.vision_config.spatial_merge_size
    tokens = (input_ids == config.image_token_id).sum(1).tolist()
    owners, sample = [], 0
    for size in (grid.prod(-1) // merge**2).tolist():
        while sample < len(tokens) and tokens[sample] == 0:
            sample += 1
        if sample == len(tokens) or tokens[sample] < size:
            raise ValueError(f"the batch's image tokens ({sum(tokens)}) do not match its images' sizes "
                             f"{(grid.prod(-1) // merge**2).tolist()} (t*h*w / {merge}^2 each, in order)")
        owners.append(sample)
        tokens[sample] -= size
    return owners


def _features(model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, mine: list[int]):
    """The tower's output for the images `mine`, the others' features zeros of their sizes."""
    rows = grid.prod(-1).tolist()
    starts = [0, *itertools.accumulate(rows)]
    if mine:
        own = model.get_image_features(torch.cat([pixels[starts[k]:starts[k] + rows[k]] for k in mine]),
                                       grid[mine], return_dict=True)
    else:  # a blank image of one merged token: the tower still runs, its collectives with it
        merge = model.config.vision_config.spatial_merge_size
        blank = torch.tensor([[1, merge, merge]], dtype=grid.dtype, device=grid.device)
        own = model.get_image_features(pixels.new_zeros(merge * merge, pixels.shape[1]), blank, return_dict=True)
    per_image = {"pooler_output": own.pooler_output}
    if getattr(own, "deepstack_features", None) is not None:
        per_image.update({f"deepstack_{i}": level for i, level in enumerate(own.deepstack_features)})
    whole = {name: _with_zeros(parts, mine, rows, model.config.vision_config.spatial_merge_size)
             for name, parts in per_image.items()}
    if not mine:  # nothing of the blank image is used, but its backward must run: add it times zero
        nothing = sum(part.sum() for parts in per_image.values() for part in parts) * 0
        whole = {name: (parts[0] + nothing, *parts[1:]) for name, parts in whole.items()}
    own.pooler_output = whole["pooler_output"]
    if "deepstack_0" in whole:
        own.deepstack_features = [whole[f"deepstack_{i}"] for i in range(len(own.deepstack_features))]
    return own


def _with_zeros(parts, mine: list[int], rows: list[int], merge: int) -> tuple:
    """Each image's features: this rank's own from `parts`, zeros of their size for the others."""
    ours = dict(zip(mine, parts))
    like = parts[0]
    return tuple(ours[k] if k in ours else like.new_zeros(n // merge**2, like.shape[-1]) for k, n in enumerate(rows))

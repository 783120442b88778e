"""Images in training examples: how a Qwen-VL model reads the pictures that LlamaFactory's multimodal data names.

A record of such data names its image files (its `images` column, paths
relative to `dataset_dir`, LlamaFactory's default `media_dir`) and marks
where each goes in its messages with an `<image>` placeholder. A
`Vision` holds what the model needs to read them: how its processor turns a
picture into patches (`hp.train.data.images.ImageSpec`: the vision tower's
patch, merge and frame sizes, and the pixel bounds and normalization of
the model directory's processor file, else Qwen3-VL's published ones, 256 x
256 to 4096 x 4096 pixels with mean and std 0.5, or for Qwen2.5-VL the
processor's defaults, 56 x 56 to 28 x 28 x 1280 with CLIP's mean and std),
LlamaFactory's `image_max_pixels` bound applied before it, and the ids its
config gives the vision tokens. An image of grid (t, h, w)
patches is `vision_start`, then t * h * w / merge**2 image tokens (one per
merged square of patches, where the vision tower's output goes), then
`vision_end` (`tokens`), as LlamaFactory's Qwen2-VL and Qwen3-VL plugins
write it.

Examples keep their images' paths; a batch reads them again and cuts them
into patches (`pixels`): `pixel_values`, every image's patch rows in the
order the images appear in the batch, and `image_grid_thw`, a row per
image. Before that, every image of every record is opened in full and its
grid found (`grids`), so a missing file, a file that is no image, or a
picture smaller than one patch is a ValueError naming the record before
any worker starts.

The images of Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE are prepared
(`READS_IMAGES`): the three share transformers' Qwen2-VL image processor,
with other settings; another vision-language model is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hp.train.data.encoding import IGNORE_INDEX
from hp.train.data.images import ImageSpec, grid_of, load_image, patchify

READS_IMAGES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # model types whose image processor `ImageSpec` is


@dataclass(frozen=True)
class Vision:
    """How a vision-language model reads images: their preprocessing and the ids of the tokens they take.

    >>> vision = Vision(ImageSpec(patch_size=4), image_token_id=9, vision_start_token_id=7, vision_end_token_id=8)
    >>> vision.tokens((1, 4, 6))  # 24 patches, merged 2 x 2 into 6 tokens
    [7, 9, 9, 9, 9, 9, 9, 8]
    """

    spec: ImageSpec
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def of(cls, config: Any, directory: str | os.PathLike | None = None, *,
           image_max_pixels: int | None = None) -> Vision | None:
        """The Vision of an HF model config; None for a text model, a ValueError for images hp does not prepare.

        `directory` is the model's (its processor file is read: `ImageSpec.of`), None for an embedded
        model; `image_max_pixels` is LlamaFactory's bound on a picture's area (None: none).

        >>> from hp.train.data.embedded import tiny_llama_config, tiny_qwen2_5_vl_config
        >>> Vision.of(tiny_llama_config(259)) is None, Vision.of(tiny_qwen2_5_vl_config(265)).image_token_id
        (True, 263)
        """
        if getattr(config, "vision_config", None) is None:
            return None
        if config.model_type not in READS_IMAGES:
            raise ValueError(
                f"{config.model_type} is a vision-language model whose images hp train does not prepare yet: it "
                f"prepares them as transformers' Qwen2-VL image processor does, for {', '.join(READS_IMAGES)}; "
                "expected one of those or a text model")
        spec = replace(ImageSpec.of(config, directory), image_max_pixels=image_max_pixels)
        return cls(spec, int(config.image_token_id), int(config.vision_start_token_id),
                   int(config.vision_end_token_id))

    def tokens(self, grid: Sequence[int]) -> list[int]:
        """The ids an image of `grid` (frames, rows, columns of patches) takes in the text."""
        t, h, w = grid
        return [self.vision_start_token_id, *[self.image_token_id] * (t * h * w // self.spec.merge_size**2),
                self.vision_end_token_id]

    def unsupervised(self, ids: Sequence[int], labels: Sequence[int]) -> list[int]:
        """`labels` with -100 wherever `ids` holds a vision token: an image is read, never predicted.

        >>> vision = Vision(ImageSpec(), image_token_id=9, vision_start_token_id=7, vision_end_token_id=8)
        >>> vision.unsupervised([1, 7, 9, 8, 2], [1, 7, 9, 8, 2])
        [1, -100, -100, -100, 2]
        """
        vision = {self.image_token_id, self.vision_start_token_id, self.vision_end_token_id}
        return [IGNORE_INDEX if i in vision else label for i, label in zip(ids, labels)]

    def grids(self, paths: Sequence[str], where: str) -> list[tuple[int, int, int]]:
        """The grid of each image file, each read in full; a ValueError starting with `where` for a bad one.

        >>> Vision(ImageSpec(), 9, 7, 8).grids(["no/such.png"], "record 3")
        Traceback (most recent call last):
        ...
        ValueError: record 3: image 0: image file no/such.png does not exist
        """
        found = []
        for k, path in enumerate(paths):
            try:
                found.append(grid_of(load_image(path), self.spec))
            except ValueError as e:
                named = f": {e}" if path in str(e) else f" ({path}): {e}"  # say which file, once
                raise ValueError(f"{where}: image {k}{named}") from None
        return found

    def pixels(self, paths: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) of the image files, in order: their patch rows end to end, a grid row each.

        >>> import tempfile
        >>> from PIL import Image
        >>> path = tempfile.mkdtemp() + "/red.png"
        >>> Image.new("RGB", (32, 32), "red").save(path)
        >>> pixels, grids = Vision(ImageSpec(patch_size=4), 9, 7, 8).pixels([path, path])
        >>> tuple(pixels.shape), grids.tolist()  # 32 x 32 pixels grow to the 56 x 56 of min_pixels
        ((392, 96), [[1, 14, 14], [1, 14, 14]])
        """
        patches, grids = zip(*(patchify(load_image(path), self.spec) for path in paths))
        return torch.cat(patches), torch.tensor(grids, dtype=torch.long)

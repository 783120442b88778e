"""Images for the Qwen-VL families: a picture file turned into the patches their vision tower reads.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL take an image as a flat list of patches
(`pixel_values`) and its grid (`grid_thw`). HF builds them with the model's
processor, which a training run should not need: processors are looked up
by name, may be fetched from the hub, and change between releases. This
module does the same work with Pillow and torch alone, and gives the same
numbers as transformers' `Qwen2VLImageProcessorPil` (the tests compare them):

1. convert to RGB, laying any transparency over white;
2. resize with bicubic resampling to `fit_size`: each side a multiple of
   `patch_size * merge_size`, the area kept within `[min_pixels,
   max_pixels]`, the aspect ratio kept as far as the rounding allows;
3. scale to [0, 1] and normalize each channel with `mean` and `std`;
4. cut into `patch_size` squares, each repeated `temporal_patch_size` times
   (a still image is one frame of a video whose frames are alike), ordered
   so that the `merge_size x merge_size` squares the tower merges into one
   token lie next to each other.

Images whose aspect ratio exceeds 200, and images smaller than one patch,
are refused with a ValueError naming their size: both would train on a
smear of a few pixels rather than on the picture. Pillow is imported only
when an image is opened or cut, so text-only runs do not need it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL.Image import Image

# HF's processors refuse images more elongated than this, so the models never saw one.
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    """How the vision tower wants its images: patch sizes, pixel bounds, normalization.

    The defaults are Qwen2-VL's and Qwen2.5-VL's processor's.

    >>> spec = ImageSpec()
    >>> spec.factor, spec.patch_dim
    (28, 1176)
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def of(cls, config: Any) -> ImageSpec:
        """The spec for an HF Qwen-VL model `config`: its vision tower's patch sizes, the other fields default.

        Pixel bounds and normalization live in the model's processor files, not in
        its config; a model whose processor differs from the defaults (Qwen3-VL's
        uses mean and std 0.5 and other bounds) needs them set with
        `dataclasses.replace`.

        >>> from types import SimpleNamespace
        >>> vision = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
        >>> ImageSpec.of(SimpleNamespace(vision_config=vision)).factor
        32
        """
        vision = config.vision_config
        return cls(patch_size=int(vision.patch_size), merge_size=int(vision.spatial_merge_size),
                   temporal_patch_size=int(vision.temporal_patch_size))

    @property
    def factor(self) -> int:
        """Pixels of one merged token, each way: what both sides of a resized image are multiples of."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The length of one row of `pixel_values`: RGB x frames x a patch's pixels."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, area within [min_pixels, max_pixels].

    Gives what transformers' `smart_resize` gives, float rounding included, so
    that the patches and the number of image tokens agree with HF's processor.

    >>> fit_size(480, 640, 28, 56 * 56, 28 * 28 * 1280)
    (476, 644)
    >>> fit_size(4000, 3000, 28, 56 * 56, 28 * 28 * 1280)
    (1148, 840)
    >>> fit_size(10, 10, 28, 56 * 56, 28 * 28 * 1280)
    (56, 56)
    """
    _check_fit_args(height, width, factor, min_pixels, max_pixels)
    fitted = _nearest(height, factor), _nearest(width, factor)
    if fitted[0] * fitted[1] > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        return max(factor, _down(height / shrink, factor)), max(factor, _down(width / shrink, factor))
    if fitted[0] * fitted[1] < min_pixels:
        # A side rounded to 0 lands here too (min_pixels >= 1), and its ceiling is at least one factor.
        grow = math.sqrt(min_pixels / (height * width))
        return _up(height * grow, factor), _up(width * grow, factor)
    return fitted


# The three roundings of a side to a multiple of factor. Each divides by factor last, as smart_resize does:
# the same float operations in the same order give the same sizes even where a quotient lands next to an integer.
def _nearest(side: float, factor: int) -> int:
    return round(side / factor) * factor  # ties to even, as smart_resize's round: 70 / 28 = 2.5 gives 56


def _down(side: float, factor: int) -> int:
    return math.floor(side / factor) * factor


def _up(side: float, factor: int) -> int:
    return math.ceil(side / factor) * factor


def _check_fit_args(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"an image of height {height} and width {width} has no pixels")
    if factor < 1 or not 1 <= min_pixels <= max_pixels:
        raise ValueError(f"fit_size needs factor >= 1 and 1 <= min_pixels <= max_pixels, got factor {factor}, "
                         f"min_pixels {min_pixels}, max_pixels {max_pixels}")
    # Compared in integers: the same as HF's float division max / min > 200 for any real image size.
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"an image of height {height} and width {width} has aspect ratio {ratio:.6g}, "
                         f"more than the {MAX_ASPECT_RATIO} the Qwen-VL processors accept")


def patchify(image: Image, spec: ImageSpec = ImageSpec()) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`image`'s patches as the Qwen-VL vision tower reads them, and its grid (frames, rows, columns of patches).

    `pixel_values` is float32 `[t * h * w, 3 * temporal_patch_size *
    patch_size**2]`: a row per patch, its channels outermost, then frames, then
    the patch's rows and columns; the rows go merge group by merge group, each
    group's `merge_size x merge_size` patches in row-major order.

    >>> from PIL import Image
    >>> pixels, grid = patchify(Image.new("RGB", (640, 480), "white"))
    >>> tuple(pixels.shape), grid
    ((1564, 1176), (1, 34, 46))
    """
    size = _fitted(image.size, spec)
    pixels = _normalized(_resized(_rgb(image), size), spec)
    return _cut(pixels, spec), _grid(size, spec)


def grid_of(image: Image, spec: ImageSpec = ImageSpec()) -> tuple[int, int, int]:
    """The grid `patchify(image, spec)` gives, found from the image's size alone (nothing is resized).

    The vision tower merges each `merge_size x merge_size` square of patches into one token, so the
    image takes `t * h * w // merge_size**2` tokens of the text. Refuses what `patchify` refuses.

    >>> from PIL import Image
    >>> grid_of(Image.new("RGB", (640, 480)))
    (1, 34, 46)
    """
    return _grid(_fitted(image.size, spec), spec)


def _fitted(size: tuple[int, int], spec: ImageSpec) -> tuple[int, int]:
    """The (height, width) an image of `size` (width, height) is resized to; refuses one smaller than a patch."""
    width, height = size
    if min(width, height) < spec.patch_size:
        raise ValueError(f"the image is {width}x{height} pixels (width x height), smaller than one "
                         f"{spec.patch_size}x{spec.patch_size} patch")
    return fit_size(height, width, spec.factor, spec.min_pixels, spec.max_pixels)


def _grid(size: tuple[int, int], spec: ImageSpec) -> tuple[int, int, int]:
    return 1, size[0] // spec.patch_size, size[1] // spec.patch_size


def _rgb(image: Image) -> Image:
    """`image` as RGB; transparent pixels shown over white (as HF's processor does), not over black."""
    from PIL import Image as PILImage

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return PILImage.alpha_composite(PILImage.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _resized(image: Image, size: tuple[int, int]) -> torch.Tensor:
    """The RGB `image` resized to `size` (height, width): uint8 `[height, width, 3]`."""
    from PIL import Image as PILImage

    height, width = size
    resized = image.resize((width, height), resample=PILImage.Resampling.BICUBIC)
    return torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(height, width, 3)


def _normalized(pixels: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    # In float32 throughout, as HF's: x / 255 there is float64 rounded to float32, the same value for every byte.
    scaled = pixels.to(torch.float32) / 255
    return (scaled - torch.tensor(spec.mean, dtype=torch.float32)) / torch.tensor(spec.std, dtype=torch.float32)


def _cut(pixels: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """Float `[H, W, 3]` pixels as patch rows, merge groups contiguous (see `patchify`)."""
    p, m, frames = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    height, width, channels = pixels.shape
    # Split each side into (merge groups, patches in a group, pixels in a patch), then order the axes as
    # group row, group column, patch row, patch column | channel, pixel row, pixel column.
    blocks = pixels.view(height // (m * p), m, p, width // (m * p), m, p, channels).permute(0, 3, 1, 4, 6, 2, 5)
    # The frames sit between the channel and the pixel rows; a still image repeats its one frame.
    blocks = blocks.unsqueeze(5).expand(*blocks.shape[:5], frames, p, p)
    return blocks.reshape(-1, channels * frames * p * p)


def load_image(path: str) -> Image:
    """The image at `path`, read in full, its file closed; a ValueError naming the path if it is missing or unreadable.

    >>> load_image("no/such/picture.png")
    Traceback (most recent call last):
    ...
    ValueError: image file no/such/picture.png does not exist
    """
    from PIL import Image as PILImage

    try:
        with PILImage.open(path) as image:
            image.load()  # decode now, so that a truncated file fails here and not when it is cut
            return image
    except FileNotFoundError as err:
        raise ValueError(f"image file {path} does not exist") from err
    except (OSError, SyntaxError, PILImage.DecompressionBombError) as err:
        raise ValueError(f"image file {path} cannot be read as an image: {err}") from err

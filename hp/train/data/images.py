"""Images for the Qwen-VL families: a picture file turned into the patches their vision tower reads.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL take an image as a flat list of patches
(`pixel_values`) and its grid (`grid_thw`). HF builds them with the model's
processor, which a training run should not need: processors are looked up
by name, may be fetched from the hub, and change between releases. This
module does the same work with Pillow and torch alone, and gives the same
numbers as transformers' `Qwen2VLImageProcessorPil`, the image processor of
all three families (the tests compare them):

0. with `image_max_pixels` (LlamaFactory's key, applied before the
   processor), shrink a larger picture to that area as LlamaFactory does
   (each side times sqrt(bound / area), truncated; Pillow's default filter);
1. convert to RGB, laying any transparency over white;
2. resize with bicubic resampling to `fit_size`: each side a multiple of
   `patch_size * merge_size`, the area kept within `[min_pixels,
   max_pixels]`, the aspect ratio kept as far as the rounding allows;
3. scale to [0, 1] and normalize each channel with `mean` and `std`;
4. cut into `patch_size` squares, each repeated `temporal_patch_size` times
   (a still image is one frame of a video whose frames are alike), ordered
   so that the `merge_size x merge_size` squares the tower merges into one
   token lie next to each other.

The families differ only in the processor's settings, which a model
directory keeps in its processor file (`processor_settings`): Qwen2.5-VL's
14-pixel patches, CLIP's mean and std; Qwen3-VL's 16-pixel patches (a
factor of 32), mean and std 0.5, and bounds written as `size:
{shortest_edge, longest_edge}`. `ImageSpec.of` reads that file, or falls
back on the model config's vision tower and the family's published
defaults (`FAMILY_DEFAULTS`).

Images whose aspect ratio exceeds 200, and images smaller than one patch,
are refused with a ValueError naming their size: both would train on a
smear of a few pixels rather than on the picture. Pillow is imported only
when an image is opened or cut, so text-only runs do not need it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL.Image import Image

# HF's processors refuse images more elongated than this, so the models never saw one.
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Where transformers finds an image processor's settings, in its order: a processor file's "image_processor"
# entry (what transformers 5 saves), else the older preprocessor_config.json.
PROCESSOR_FILES = (("processor_config.json", "image_processor"), ("preprocessor_config.json", None))
# The processor settings of a family whose model directory has no processor file: Qwen3-VL's published
# preprocessor_config.json (Qwen/Qwen3-VL-*); Qwen2.5-VL takes the processor class's defaults, `ImageSpec`'s.
QWEN3_VL_IMAGES = {"min_pixels": 65536, "max_pixels": 16777216, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = {"qwen3_vl": QWEN3_VL_IMAGES, "qwen3_vl_moe": QWEN3_VL_IMAGES}
# The steps hp always takes, as the processor's switches name them: a file that turns one off is refused.
_ALWAYS = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
           "rescale_factor": 1 / 255}
_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class ImageSpec:
    """How the vision tower wants its images: patch sizes, pixel bounds, normalization.

    The defaults are Qwen2-VL's processor class's, which Qwen2.5-VL uses; `image_max_pixels` is
    LlamaFactory's bound on a picture's area before the processor's (None: none).

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
    image_max_pixels: int | None = None

    @classmethod
    def of(cls, config: Any, directory: str | os.PathLike | None = None) -> ImageSpec:
        """The spec for an HF Qwen-VL model `config` whose files are in `directory` (None: an embedded model).

        The directory's processor file (`processor_settings`) gives the settings it
        names, and the processor class's defaults (`ImageSpec`'s) stand for the others,
        as when transformers builds the processor from it, except the tower's sizes:
        those come from the config, and a file naming other ones is refused. Without a
        file, the config's tower and `FAMILY_DEFAULTS` decide.

        >>> from types import SimpleNamespace
        >>> vision = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
        >>> spec = ImageSpec.of(SimpleNamespace(model_type="qwen3_vl", vision_config=vision))
        >>> spec.factor, spec.min_pixels, spec.mean
        (32, 65536, (0.5, 0.5, 0.5))
        """
        vision = config.vision_config
        tower = {"patch_size": int(vision.patch_size), "merge_size": int(vision.spatial_merge_size),
                 "temporal_patch_size": int(vision.temporal_patch_size)}
        found = processor_settings(directory) if directory is not None else None
        if found is None:
            return cls(**tower, **FAMILY_DEFAULTS.get(getattr(config, "model_type", ""), {}))
        path, settings = found
        spec = cls(**{**tower, **_read_settings(settings, path)})
        for key, size in tower.items():
            if getattr(spec, key) != size:
                name = "spatial_merge_size" if key == "merge_size" else key
                raise ValueError(f"{path}: {key} = {getattr(spec, key)} is not the model's vision_config.{name} = "
                                 f"{size} (config.json); expected the processor file of this model")
        return spec

    @property
    def factor(self) -> int:
        """Pixels of one merged token, each way: what both sides of a resized image are multiples of."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The length of one row of `pixel_values`: RGB x frames x a patch's pixels."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def processor_settings(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The image processor's settings in a model directory, with the file they are from; None if it has none.

    Looked up as transformers does (`PROCESSOR_FILES`); bad JSON is a ValueError naming the file.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> _ = (directory / "preprocessor_config.json").write_text('{"patch_size": 16}')
    >>> processor_settings(directory)[1], processor_settings(directory / "none") is None
    ({'patch_size': 16}, True)
    """
    for name, entry in PROCESSOR_FILES:
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot be read as JSON: {e}") from None
        if entry is not None:
            if not isinstance(settings, dict) or entry not in settings:
                continue  # a processor file without image settings: transformers reads the next file
            settings = settings[entry]
        if not isinstance(settings, dict):
            where = f"{path}: {entry}" if entry else str(path)
            raise ValueError(f"{where}: expected a JSON object of image processor settings, got {settings!r}")
        return path, settings
    return None


def _read_settings(settings: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """ImageSpec's fields from a processor file's settings, checked: a bad value is a ValueError naming file and key."""
    def bad(key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"{path}: {key} = {value!r} is not taken; expected {expected}")

    kind = settings.get("image_processor_type")
    if kind is not None and kind not in _PROCESSOR_TYPES:
        raise bad("image_processor_type", kind, f"one of {', '.join(_PROCESSOR_TYPES)} (the Qwen-VL processors)")
    for key, wanted in _ALWAYS.items():
        if key in settings and not _same(settings[key], wanted):
            raise bad(key, settings[key], f"{wanted!r}, what hp train does (the Qwen-VL processors' default)")
    found: dict[str, tuple[str, Any]] = {}  # field: (key, value)
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if key in settings:
            found[key] = key, settings[key]
    # As the processor's __init__: a size object replaces both default bounds, and min_pixels and max_pixels
    # (older files) override its two.
    size = settings.get("size")
    if size is not None and not isinstance(size, dict):
        raise bad("size", size, "an object {shortest_edge, longest_edge}")
    for field, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if settings.get(field) is not None:
            found[field] = field, settings[field]
        elif size is not None:
            if edge not in size:
                raise ValueError(f"{path}: size has no {edge} (nor the file {field}); expected size: "
                                 "{shortest_edge, longest_edge}, the least and most pixels an image is resized to")
            found[field] = f"size.{edge}", size[edge]
    fields = {}
    for field, (key, value) in found.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(key, value, "a positive integer")
        fields[field] = value
    low, high = fields.get("min_pixels", ImageSpec.min_pixels), fields.get("max_pixels", ImageSpec.max_pixels)
    if low > high:
        key = found.get("min_pixels", ("size.shortest_edge",))[0]
        raise bad(key, low, f"at most the largest area, {high} pixels")
    for key, field in (("image_mean", "mean"), ("image_std", "std")):
        if key in settings:
            fields[field] = _channels(settings[key])
            if fields[field] is None or (field == "std" and 0 in fields[field]):
                raise bad(key, settings[key], "a number or a list of 3 numbers (std: none of them 0)")
    return fields


def _same(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, bool) or isinstance(value, bool):
        return value is wanted
    return isinstance(value, (int, float)) and math.isclose(value, wanted, rel_tol=1e-9)


def _channels(value: Any) -> tuple[float, float, float] | None:
    """A mean or std as three floats (a number stands for all three, as the processor broadcasts it); None if bad."""
    values = [value] * 3 if isinstance(value, (int, float)) else value
    if (not isinstance(values, list) or len(values) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        return None
    return (float(values[0]), float(values[1]), float(values[2]))


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
    bounded = bounded_size(image.size, spec.image_max_pixels)
    if bounded != image.size:
        image = image.resize(bounded)  # as LlamaFactory calls it: Pillow's default filter, in the picture's own mode
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


def bounded_size(size: tuple[int, int], image_max_pixels: int | None) -> tuple[int, int]:
    """The (width, height) LlamaFactory shrinks a picture of `size` to before its processor: at most
    `image_max_pixels` in area (None: no bound), the same float operations as its `_preprocess_image`.

    >>> bounded_size((1024, 768), 512 * 512), bounded_size((1024, 768), None), bounded_size((300, 200), 512 * 512)
    ((591, 443), (1024, 768), (300, 200))
    """
    width, height = size
    if image_max_pixels is None or width * height <= image_max_pixels:
        return size
    scale = math.sqrt(image_max_pixels / (width * height))
    return int(width * scale), int(height * scale)


def _fitted(size: tuple[int, int], spec: ImageSpec) -> tuple[int, int]:
    """The (height, width) an image of `size` (width, height) is resized to; refuses one smaller than a patch."""
    width, height = size
    if min(width, height) < spec.patch_size:
        raise ValueError(f"the image is {width}x{height} pixels (width x height), smaller than one "
                         f"{spec.patch_size}x{spec.patch_size} patch")
    bounded = bounded_size(size, spec.image_max_pixels)
    if bounded != size:
        _check_fit_args(height, width, spec.factor, spec.min_pixels, spec.max_pixels)  # refused as the picture is
        if min(bounded) < 1:
            raise ValueError(f"image_max_pixels = {spec.image_max_pixels} shrinks the image of {width}x{height} "
                             f"pixels (width x height) to {bounded[0]}x{bounded[1]}, no picture at all")
        width, height = bounded
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

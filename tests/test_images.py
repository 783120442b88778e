"""hp.train.data.images gives the patches and grids of transformers' Qwen-VL image processor, and names bad images.

The reference is `Qwen2VLImageProcessorPil` (Qwen2.5-VL's and Qwen3-VL's
image processor), built here from the same sizes and normalization, or read
by transformers itself from the processor file written to a tmp directory
(nothing is fetched); LlamaFactory's `image_max_pixels` shrink before it is
its `_preprocess_image`, restated. The images are drawn with Pillow, saved
as PNG or JPEG and read back with `load_image`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from hp.models import tiny_config
from hp.train.data.images import QWEN3_VL_IMAGES, ImageSpec, fit_size, grid_of, load_image, patchify

TINY = ImageSpec(patch_size=4, merge_size=2, temporal_patch_size=2)  # the tiny models' vision tower
# Tiny patches with a small pixel budget: most images shrink, the smallest grow.
TINY_BOUNDED = dataclasses.replace(TINY, min_pixels=16 * 16, max_pixels=48 * 48)
SPECS = {"default": ImageSpec(), "tiny": TINY, "tiny_bounded": TINY_BOUNDED}


def reference(image: Image.Image, spec: ImageSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    processor = Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size, merge_size=spec.merge_size, temporal_patch_size=spec.temporal_patch_size,
        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, image_mean=list(spec.mean), image_std=list(spec.std))
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


@st.composite
def fit_args(draw):
    factor = draw(st.sampled_from([8, 28, 32]) | st.integers(1, 64))
    min_pixels = draw(st.sampled_from([56 * 56, 128 * 32 * 32, factor * factor]) | st.integers(1, 200_000))
    max_pixels = draw(st.sampled_from([28 * 28 * 1280, 16_777_216]) | st.integers(min_pixels, 4_000_000))
    sides = st.integers(1, 4000)
    return draw(sides), draw(sides), factor, min_pixels, max(min_pixels, max_pixels)


@settings(max_examples=500)
@given(fit_args())
@example((70, 70, 28, 56 * 56, 28 * 28 * 1280))  # 2.5 factors: rounds to even
@example((10, 1000, 28, 56 * 56, 28 * 28 * 1280))  # a side rounds to 0
@example((4000, 20, 28, 56 * 56, 28 * 28 * 1280))  # aspect ratio exactly 200: accepted
@example((4000, 19, 28, 56 * 56, 28 * 28 * 1280))  # just over 200: refused
@example((3999, 1, 28, 56 * 56, 28 * 28 * 1280))
def test_fit_size_is_transformers_smart_resize(args):
    try:
        want = smart_resize(*args)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            fit_size(*args)
        return
    got = fit_size(*args)
    assert got == want
    factor = args[2]
    assert got[0] % factor == 0 and got[1] % factor == 0 and min(got) >= factor


def noise(size: tuple[int, int], mode: str, seed: int) -> Image.Image:
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = random.Random(seed).randbytes(size[0] * size[1] * bands)
    return Image.frombytes(mode, size, data)


def drawing(size: tuple[int, int], mode: str) -> Image.Image:
    # Sharp edges on a flat ground: what resampling smooths most, and a half-transparent shape in RGBA.
    image = Image.new("RGBA", size, (30, 90, 200, 255))
    draw = ImageDraw.Draw(image)
    w, h = size
    draw.ellipse((w // 5, h // 6, 4 * w // 5, 5 * h // 6), fill=(250, 200, 10, 120))
    draw.line((0, 0, w - 1, h - 1), fill=(0, 0, 0, 255), width=3)
    return image if mode == "RGBA" else image.convert(mode)


FORMS = [(size, mode, fmt) for size in [(57, 83), (224, 224), (30, 400), (640, 480)] for mode in ["RGB", "RGBA", "L"]
         for fmt in ["png", "jpeg"] if not (mode == "RGBA" and fmt == "jpeg")]  # JPEG has no alpha
# Every form with the default spec; the tiny specs on the PNGs (how a file is read does not depend on the spec).
CASES = [(*form, name) for name in SPECS for form in FORMS if name == "default" or form[2] == "png"]


@pytest.mark.parametrize("content", ["noise", "drawing"])
@pytest.mark.parametrize(("size", "mode", "fmt", "spec_name"), CASES,
                         ids=[f"{w}x{h}-{m}-{f}-{name}" for (w, h), m, f, name in CASES])
def test_patchify_is_transformers_processor(tmp_path, content, size, mode, fmt, spec_name):
    spec = SPECS[spec_name]
    made = noise(size, mode, seed=sum(size) + len(mode)) if content == "noise" else drawing(size, mode)
    path = tmp_path / f"image.{fmt}"
    made.save(path)
    image = load_image(str(path))
    assert image.mode == mode and image.size == size

    pixels, grid = patchify(image, spec)
    want_pixels, want_grid = reference(image, spec)
    assert grid == want_grid
    assert pixels.dtype == torch.float32 and pixels.shape == (grid[0] * grid[1] * grid[2], spec.patch_dim)
    assert torch.equal(pixels, want_pixels)


def test_patch_rows_go_merge_group_by_merge_group():
    # Pixel values that name their position show the order without a reference.
    spec = dataclasses.replace(TINY, min_pixels=16 * 16, mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))
    rows, cols = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    image = Image.frombytes("RGB", (16, 16), bytes(torch.stack([rows, cols, rows * 0], -1).flatten().tolist()))
    pixels, grid = patchify(image, spec)
    assert grid == (1, 4, 4)
    patches = pixels.round().to(torch.int64).view(16, 3, 2, 4, 4)  # patch, channel, frame, row, column
    assert torch.equal(patches[:, :, 0], patches[:, :, 1])  # the one frame, repeated
    corners = [(int(p[0, 0, 0, 0]), int(p[1, 0, 0, 0])) for p in patches]  # (row, column) of each top-left pixel
    # Group (0, 0) holds patches (0, 0) (0, 1) (1, 0) (1, 1), then group (0, 1) ...
    assert corners[:8] == [(0, 0), (0, 4), (4, 0), (4, 4), (0, 8), (0, 12), (4, 8), (4, 12)]


def test_spec_of_reads_the_vision_config_and_the_familys_defaults_without_a_processor_file(tmp_path):
    assert ImageSpec.of(tiny_config("qwen2_5_vl")) == TINY == ImageSpec.of(tiny_config("qwen2_5_vl"), tmp_path)
    from transformers import Qwen3VLConfig

    spec = ImageSpec.of(Qwen3VLConfig(), tmp_path)  # Qwen3-VL's published processor: 256^2 to 4096^2 pixels, 0.5
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size, spec.factor) == (16, 2, 2, 32)
    assert (spec.min_pixels, spec.max_pixels, spec.mean, spec.std) == (256 * 256, 4096 * 4096, (0.5,) * 3, (0.5,) * 3)
    assert ImageSpec.of(tiny_config("qwen3_vl_moe")) == dataclasses.replace(TINY, **QWEN3_VL_IMAGES)


# Qwen3-VL's preprocessor_config.json as its model directories ship it.
QWEN3_VL_FILE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "image_processor_type": "Qwen2VLImageProcessorFast"}


def tower(settings: dict) -> SimpleNamespace:
    """A model config whose vision tower has the sizes of a processor file's `settings`."""
    vision = SimpleNamespace(patch_size=settings.get("patch_size", 14), temporal_patch_size=settings.get(
        "temporal_patch_size", 2), spatial_merge_size=settings.get("merge_size", 2))
    return SimpleNamespace(model_type="qwen3_vl", vision_config=vision)


def llamafactory_bound(image: Image.Image, image_max_pixels: int) -> Image.Image:
    # LlamaFactory's MMPluginMixin._preprocess_image, its image_max_pixels step, as it is written there
    if (image.width * image.height) > image_max_pixels:
        resize_factor = math.sqrt(image_max_pixels / (image.width * image.height))
        width, height = int(image.width * resize_factor), int(image.height * resize_factor)
        image = image.resize((width, height))
    return image


@st.composite
def processor_files(draw):
    """A processor file's settings in any of the forms transformers reads, and how it is written."""
    patch = draw(st.sampled_from([4, 8, 14, 16]))
    merge = draw(st.sampled_from([1, 2]))
    low = draw(st.integers(1, 64 * 64))
    high = draw(st.integers(low, 160 * 160))
    settings = {"patch_size": patch, "merge_size": merge, "temporal_patch_size": draw(st.sampled_from([1, 2]))}
    bounds = draw(st.sampled_from(["size", "legacy", "both"]))
    if bounds in ("size", "both"):
        settings["size"] = {"shortest_edge": low, "longest_edge": high}
    if bounds in ("legacy", "both"):  # older files: min_pixels and max_pixels win over size
        settings.update(min_pixels=low, max_pixels=high)
        if bounds == "both":
            settings["size"] = {"shortest_edge": 1, "longest_edge": 2}
    norm = draw(st.sampled_from(["qwen3", "clip", "scalar", "none"]))
    if norm != "none":
        mean, std = {"qwen3": ([0.5] * 3, [0.5] * 3), "clip": ([0.48145466, 0.4578275, 0.40821073],
                                                               [0.26862954, 0.26130258, 0.27577711]),
                     "scalar": (0.25, 0.75)}[norm]
        settings.update(image_mean=mean, image_std=std)
    return settings, draw(st.sampled_from(["preprocessor_config.json", "processor_config.json"]))


@given(processor_files(), st.tuples(st.integers(16, 400), st.integers(16, 400)), st.integers(0, 3),
       st.sampled_from([None, 32 * 32, 100 * 80]))
@example((QWEN3_VL_FILE, "preprocessor_config.json"), (640, 480), 0, None)  # Qwen3-VL's own: 480 grows to 512
@example((QWEN3_VL_FILE, "preprocessor_config.json"), (900, 700), 1, 512 * 512)  # the qwen3vl example's bound
def test_a_processor_file_is_read_as_transformers_reads_it(file, size, seed, image_max_pixels):
    settings, name = file
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / name
        path.write_text(json.dumps({"image_processor": settings} if name == "processor_config.json" else settings))
        spec = dataclasses.replace(ImageSpec.of(tower(settings), directory), image_max_pixels=image_max_pixels)
        processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    image = noise(size, "RGB", seed)
    pixels, grid = patchify(image, spec)
    bounded = image if image_max_pixels is None else llamafactory_bound(image, image_max_pixels)
    want = processor(images=[bounded], return_tensors="pt")
    assert grid == grid_of(image, spec) == tuple(want["image_grid_thw"][0].tolist())
    assert torch.equal(pixels, want["pixel_values"])


@pytest.mark.parametrize("settings, key, value", [
    ({"patch_size": "16"}, "patch_size", "'16'"),
    ({"size": {"shortest_edge": -1, "longest_edge": 4096}}, "size.shortest_edge", "-1"),
    ({"size": {"shortest_edge": 65536}}, "size", None),  # no longest_edge: transformers refuses it too
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels", "5000"),
    ({"image_std": [0.5, 0, 0.5]}, "image_std", "[0.5, 0, 0.5]"),
    ({"image_mean": [0.5, 0.5]}, "image_mean", "[0.5, 0.5]"),
    ({"do_normalize": False}, "do_normalize", "False"),
    ({"resample": 2}, "resample", "2"),
    ({"image_processor_type": "CLIPImageProcessor"}, "image_processor_type", "'CLIPImageProcessor'"),
    ({"patch_size": 14}, "patch_size", "14"),  # not the tower's 16
], ids=["string", "negative", "half_a_size", "min_over_max", "zero_std", "two_means", "no_normalize", "bilinear",
        "other_processor", "other_tower"])
def test_a_bad_processor_setting_is_one_error_naming_the_file_and_key(tmp_path, settings, key, value):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({**QWEN3_VL_FILE, **settings}))
    said = f"{key} = {value} is" if value is not None else "size has no longest_edge"
    with pytest.raises(ValueError, match=re.escape(f"{path}: {said}")):
        ImageSpec.of(tower(QWEN3_VL_FILE), tmp_path)


def test_a_processor_file_that_is_no_json_is_named(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{size: 3")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'preprocessor_config.json'}: cannot be read as JSON")):
        ImageSpec.of(tower(QWEN3_VL_FILE), tmp_path)


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "gone.png"
    with pytest.raises(ValueError, match=re.escape(f"image file {path} does not exist")):
        load_image(str(path))


def test_text_file_named_png_is_named(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not a picture\n")
    with pytest.raises(ValueError, match=re.escape(f"image file {path} cannot be read as an image")):
        load_image(str(path))


def test_truncated_file_is_named(tmp_path):
    path = tmp_path / "cut.png"
    noise((64, 64), "RGB", seed=0).save(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=re.escape(f"image file {path} cannot be read as an image")):
        load_image(str(path))


@pytest.mark.parametrize(("size", "spec"), [((13, 500), ImageSpec()), ((500, 3), TINY), ((2, 2), TINY)])
def test_image_smaller_than_a_patch_is_refused(size, spec):
    w, h = size
    match = rf"{w}x{h} pixels \(width x height\), smaller than one {spec.patch_size}x{spec.patch_size} patch"
    with pytest.raises(ValueError, match=match):
        patchify(Image.new("RGB", size), spec)


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ValueError, match=r"height 14 and width 2815 has aspect ratio 201\.071, more than the 200"):
        patchify(Image.new("RGB", (2815, 14)))
    with pytest.raises(ValueError, match=r"height 4001 and width 20 has aspect ratio 200\.05,"):
        fit_size(4001, 20, 28, 56 * 56, 28 * 28 * 1280)

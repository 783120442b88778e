"""`hp train` on LlamaFactory's multimodal data: the reader, its batches, bad images by record, the tiny Qwen-VLs.

Datasets are written to tmp_path with Pillow in LlamaFactory's `mllm_demo`
layout (sharegpt messages with `<image>` placeholders, an `images` column of
paths relative to the dataset directory) and read with the embedded
`hp/tiny-qwen2.5-vl`'s tokenizer and vision config (4-pixel patches merged
2 x 2: an 8k x 8k picture is k x k image tokens, at least 56 x 56 pixels),
or with a tiny local Qwen3-VL directory's (its processor file written as
Qwen3-VL's: 32 x 32 to 64 x 64 pixels, mean and std 0.5).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from train_runs import TINY_QWEN3_VL_PROCESSOR, hp_train, local_vl_model, losses, summary

import hp.cli
from hp.parallel.strategy import Strategy
from hp.train.config import ConfigError
from hp.train.config.templates import TEMPLATES, VISION_TEMPLATES
from hp.train.data import IGNORE_INDEX, TokenBatches, build_examples, collate, load_tokenizer
from hp.train.data.embedded import TINY_QWEN2_5_VL, tiny_qwen2_5_vl_config
from hp.train.data.images import ImageSpec, load_image, patchify
from hp.train.data.quickstart_vl import INFO
from hp.train.data.vision import Vision
from hp.train.loader import Prefetched
from hp.train.model import check_fits

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_VL = str(ROOT / "examples" / "quickstart_vl.yaml")
TOK = load_tokenizer(TINY_QWEN2_5_VL)
CONFIG = tiny_qwen2_5_vl_config(TOK.vocab_size)
VISION = Vision.of(CONFIG)
SIZES = {"a.png": (16, 24), "b.png": (80, 64), "c.png": (40, 40)}  # (width, height): they grow, stay, grow


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def dataset(directory: Path, records: list[dict], info: dict = INFO, images: dict | None = None) -> Path:
    """`records` as the dataset `d` of `directory`, in mllm_demo's layout; `images` (name: (w, h) or bytes) in pics/."""
    (directory / "pics").mkdir(parents=True, exist_ok=True)
    for name, content in (SIZES if images is None else images).items():
        if isinstance(content, bytes):
            (directory / "pics" / name).write_bytes(content)
        else:
            Image.effect_noise(content, 60).convert("RGB").save(directory / "pics" / name)
    (directory / "dataset_info.json").write_text(json.dumps({"d": {**info, "file_name": "d.json"}}))
    (directory / "d.json").write_text(json.dumps(records))
    return directory


RECORDS = [
    {"messages": [user("<image>What is it?"), assistant("noise")], "images": ["pics/a.png"]},
    {"messages": [user("Compare <image> and<image>."), assistant("same"), user("Sure?"), assistant("yes")],
     "images": ["pics/b.png", "pics/c.png"]},
    {"messages": [user("No picture here."), assistant("fine")]},
]


def read(directory: Path, **options):
    return build_examples("d", directory, TOK, template=options.pop("template", "qwen2_vl"),
                          cutoff_len=options.pop("cutoff_len", 512), vision=options.pop("vision", VISION), **options)


def test_the_reader_places_each_image_as_its_tokens_and_batches_its_patches(tmp_path):
    data = read(dataset(tmp_path, RECORDS))
    assert data.vision == VISION and VISION.spec == ImageSpec(patch_size=4)  # the processor's defaults otherwise
    paths = [str(tmp_path / "pics" / name) for name in ("a.png", "b.png", "c.png")]
    assert [e.get("images", []) for e in data.examples] == [paths[:1], paths[1:], []]
    patches = [patchify(load_image(p), VISION.spec) for p in paths]
    grids = [grid for _, grid in patches]
    assert grids == [(1, 18, 12), (1, 16, 20), (1, 14, 14)]  # 16 x 24 grows to 48 x 72, 80 x 64 stays, 40 x 40 to 56
    for example, its_grids in zip(data.examples, (grids[:1], grids[1:], [])):
        ids, labels = example["input_ids"], example["labels"]
        starts = [k for k, i in enumerate(ids) if i == CONFIG.vision_start_token_id]
        assert len(starts) == len(its_grids)
        for start, (t, h, w) in zip(starts, its_grids):  # start, t*h*w / merge^2 image tokens, end
            n = t * h * w // 4
            assert ids[start + 1 : start + 2 + n] == [CONFIG.image_token_id] * n + [CONFIG.vision_end_token_id]
        supervised = TOK.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])
        assert all(label == IGNORE_INDEX for i, label in zip(ids, labels) if i >= CONFIG.vision_start_token_id)
        assert supervised == {0: "noise\n", 1: "same\nyes\n", 2: "fine\n"}[data.examples.index(example)]
    text = TOK.decode(data[0]["input_ids"])  # the vision tokens carry no text; LlamaFactory's qwen2_vl rendering
    assert text == ("system\nYou are a helpful assistant.\nuser\nWhat is it?\nassistant\nnoise\n")
    assert data[1]["input_ids"][: data[1]["input_ids"].index(CONFIG.vision_start_token_id)][-8:] == TOK.encode("Compare ")

    batch = collate(data.examples, TOK.pad_token_id, vision=data.vision)
    assert list(batch.inputs()) == ["input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw"]
    assert torch.equal(batch.pixel_values, torch.cat([p for p, _ in patches]))  # in the order the images appear
    assert batch.image_grid_thw.tolist() == [list(g) for g in grids]
    assert torch.equal(batch.mm_token_type_ids, (batch.input_ids == CONFIG.image_token_id).int())
    assert int(batch.mm_token_type_ids.sum()) == sum(t * h * w // 4 for t, h, w in grids)
    text_only = collate(data.examples[2:], TOK.pad_token_id, vision=data.vision)
    assert list(text_only.inputs()) == ["input_ids", "labels", "mm_token_type_ids"]
    assert data.summary().endswith("3 images")


def test_the_tiny_vl_tokenizer_reads_qwens_tokens_whole_as_its_hf_export_does():
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>héllo <|im_end|x<|im_end|>"
    ids = TOK.encode(text)
    assert ids[:3] == [259, 117, 115] and ids.count(CONFIG.image_token_id) == 1 and ids[-1] == 260
    assert ids == TOK.as_hf().encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == "user\nhéllo <|im_end|x"  # special tokens carry no text


def test_loader_processes_read_and_cut_the_same_images(tmp_path):
    data = read(dataset(tmp_path, RECORDS * 2))
    plain, ahead = (TokenBatches(data, 2, 0, TOK.pad_token_id, vision=data.vision) for _ in range(2))
    ahead = Prefetched(ahead, workers=1)
    for _ in range(4):
        want, got = next(plain), next(ahead)
        assert want.inputs().keys() == got.inputs().keys() and all(torch.equal(w, g) for w, g in zip(want, got))


def test_qwen2_vl_is_the_checked_qwen_template_with_its_system_prompt_and_the_image_plugin():
    # LlamaFactory registers qwen2_vl as its qwen template with "You are a helpful assistant." and the Qwen2-VL
    # plugin, so the text of a record encodes as qwen's, which tests/test_templates.py holds to LlamaFactory's goldens
    want = dataclasses.replace(TEMPLATES["qwen"], name="qwen2_vl", default_system="You are a helpful assistant.",
                               mm_plugin="qwen2_vl")
    assert VISION_TEMPLATES["qwen2_vl"] == want


def test_text_batches_hold_input_ids_and_labels_only():
    rows = [{"input_ids": [1, 2], "labels": [1, 2]}] * 3
    batch = next(TokenBatches(rows, 2, 0, pad_id=0))
    assert list(batch.inputs()) == ["input_ids", "labels"]  # the text model is called as before images existed
    ids, labels = batch
    assert ids is batch.input_ids and labels is batch.labels


def _bad(tmp_path, record: dict | None = None, **images) -> Path:
    images = {**SIZES, **images}
    return dataset(tmp_path, [RECORDS[0], record or RECORDS[0]], images=images)


WHERE = r"dataset 'd' \(.*d\.json, record 1\)"


@pytest.mark.parametrize("record, images, message", [
    ({**RECORDS[0], "images": ["pics/gone.png"]}, {}, WHERE + r": image 0: image file .*pics/gone\.png does not exist"),
    ({**RECORDS[0], "images": ["pics/x.png"]}, {"x.png": b"not a picture"},
     WHERE + r": image 0: image file .*pics/x\.png cannot be read as an image"),
    ({**RECORDS[0], "images": ["pics/x.png"]}, {"x.png": (3, 40)},
     WHERE + r": image 0 \(.*pics/x\.png\): the image is 3x40 pixels \(width x height\), smaller than one 4x4 patch"),
    ({"messages": [user("<image><image>Two?"), assistant("one")], "images": ["pics/a.png"]}, {},
     WHERE + r": its messages hold 2 <image> placeholder\(s\) and its column 'images' names 1 image\(s\)"),
    ({"messages": [user("Where?"), assistant("here")], "images": ["pics/a.png"]}, {},
     WHERE + r": its messages hold 0 <image> placeholder\(s\) and its column 'images' names 1 image\(s\)"),
    ({**RECORDS[0], "images": [3]}, {}, WHERE + r": 'images' must be a list of image file paths"),
    ({"messages": [user("<image>"), assistant("x")], "images": ["pics/big.png"]}, {"big.png": (400, 400)},
     WHERE + r": cutoff_len = 512 cuts through its images \(1 image\(s\) of 2500 image tokens in a conversation of "
     r"2562 tokens\); hp train does not cut an image.*expected cutoff_len >= 2562"),
], ids=["missing", "not_an_image", "smaller_than_a_patch", "more_placeholders", "fewer_placeholders", "not_paths",
        "cut_by_cutoff_len"])
def test_a_bad_record_is_named(tmp_path, record, images, message):
    with pytest.raises(ValueError, match=message):
        read(_bad(tmp_path, record, **images))


def test_images_need_a_vision_model_a_template_placing_them_and_sft(tmp_path):
    directory = dataset(tmp_path, RECORDS)
    where = r"dataset 'd' \(.*d\.json\): its records have images \(column 'images'\)"
    with pytest.raises(ValueError, match=where + r", but the model is a text model, which reads none; expected a "
                                              r"vision-language model \(model_name_or_path: hp/tiny-qwen2.5-vl"):
        read(directory, vision=None)
    with pytest.raises(ValueError, match=where + r", but template 'qwen' places none .*expected template: qwen2_vl"):
        read(directory, template="qwen")
    with pytest.raises(ValueError, match=where + r", which stage pt does not read"):
        read(directory, stage="pt", template="empty")
    text = dataset(tmp_path / "text", RECORDS[2:], info={"formatting": "sharegpt", "columns": {"messages": "messages"},
                                                          "tags": INFO["tags"]})
    assert read(text, vision=None).examples[0].keys() == {"input_ids", "labels"}  # text data, text model: as before


def test_the_model_is_checked_for_images_before_any_worker(tmp_path, capsys):
    check_fits(CONFIG, Strategy(tp=2), name=TINY_QWEN2_5_VL)  # the decoder splits over tp; the tower is replicated
    from transformers import AutoConfig

    from hp.models import tiny_config

    check_fits(tiny_config("qwen3_vl"), Strategy(tp=2))
    with pytest.raises(ValueError, match=r"^llava is a vision-language model whose images hp train does not prepare "
                                         r"yet: .* for qwen2_5_vl, qwen3_vl, qwen3_vl_moe; expected one of those"):
        Vision.of(AutoConfig.for_model("llava"))
    directory = _bad(tmp_path / "data", {**RECORDS[0], "images": ["pics/gone.png"]})
    code = hp.cli.main(["train", QUICKSTART_VL, f"dataset_dir={directory}", "dataset=d",
                        f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(WHERE + r": image 0: image file .*gone\.png does not exist", err), err
    assert not (tmp_path / "out").exists()


def test_the_tiny_vl_models_loss_on_a_reader_batch_is_hfs_with_its_processor_and_m_rope(tmp_path):
    """The batch is well formed: HF's own image processor and M-RoPE positions give the same loss, 1-D ones another."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    data = read(dataset(tmp_path, RECORDS))
    batch = collate(data.examples, TOK.pad_token_id, vision=data.vision)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(CONFIG)
    out = model(**batch.inputs())
    spec = VISION.spec
    processor = Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=spec.merge_size,
                                         temporal_patch_size=spec.temporal_patch_size, min_pixels=spec.min_pixels,
                                         max_pixels=spec.max_pixels, image_mean=list(spec.mean),
                                         image_std=list(spec.std))
    images = [Image.open(p).convert("RGB") for e in data.examples for p in e.get("images", [])]
    hf = processor(images=images, return_tensors="pt")
    assert_hf_loss_and_logits(model, batch, hf, CONFIG.image_token_id, out)
    flat = model(input_ids=batch.input_ids, labels=batch.labels, pixel_values=batch.pixel_values,
                 image_grid_thw=batch.image_grid_thw)  # no mm_token_type_ids: HF falls back to 1-D positions
    assert (flat.logits - out.logits).abs().max() > 1e-3


def test_the_vl_quickstart_trains_on_two_workers_and_evaluates_as_hf(tmp_path):
    """tp=2 on gloo workers: the loss falls, and the held-out loss is HF's on the checkpoint's weights."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hp.train.checkpoint import load_model_weights
    from hp.train.config import load_config
    from hp.train.data import load_splits

    overrides = ["max_steps=8", "save_steps=8", "logging_steps=1", "per_device_train_batch_size=8",
                 "learning_rate=3e-3", "warmup_ratio=0", "do_eval=true", f"output_dir={tmp_path}",
                 f"dataset_dir={ROOT / 'examples' / 'data'}"]
    result = summary(hp_train(*overrides, config=QUICKSTART_VL))
    assert result["steps"] == 8 and result["comm_bytes_per_step"]["tp"] > 0
    assert result["last_loss"] < 0.8 * result["first_loss"], result
    _, held = load_splits(load_config(QUICKSTART_VL, overrides), TOK)
    model = Qwen2_5_VLForConditionalGeneration(CONFIG)
    load_model_weights(str(tmp_path / "checkpoint-8"), model)
    want = model(**collate(held.examples, TOK.pad_token_id, vision=held.vision).inputs()).loss.item()
    assert result["eval_loss"] == pytest.approx(want, rel=1e-5)


def test_the_tower_and_projector_are_frozen_by_default_as_in_llamafactory():
    from hp.train.config import validate
    from hp.train.model import build_model, freeze_parts

    minimal = {"model_name_or_path": TINY_QWEN2_5_VL, "dataset": "quickstart_vl", "output_dir": "out"}
    cfg = validate(minimal)
    assert (cfg.freeze_vision_tower, cfg.freeze_multi_modal_projector, cfg.freeze_language_model) == (True, True, False)
    model = build_model(TINY_QWEN2_5_VL, 265, hp.mesh(tp=1, simulate=True), Strategy(), seed=0)
    assert freeze_parts(model, vision_tower=True, projector=True, language_model=False) == ["vision_tower", "projector"]
    training = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {"lm_head.weight", "model.language_model.embed_tokens.weight"} <= training
    assert not any(name.startswith("model.visual.") for name in training)
    with pytest.raises(ConfigError, match="leaves nothing to train"):
        validate({**minimal, "freeze_language_model": True})


def test_a_local_qwen2_5_vl_directory_is_read_under_the_names_transformers_saves(tmp_path):
    from transformers import AutoModelForImageTextToText

    from hp.models import tiny_config
    from hp.train.model import build_model

    torch.manual_seed(0)
    saved = AutoModelForImageTextToText.from_config(tiny_config("qwen2_5_vl", layers=1))
    saved.save_pretrained(tmp_path)  # as `model.layers.*` and `visual.*`, not the modules' names
    model = build_model(str(tmp_path), 256, hp.mesh(tp=1, simulate=True), Strategy(), seed=1)
    for (name, p), want in zip(model.named_parameters(), saved.parameters()):
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(got.detach(), want.detach()), name


@pytest.mark.parametrize("name, text", [("qwen3_vl", "qwen3"), ("qwen3_vl_nothink", "qwen3_nothink")])
def test_qwen3_vl_templates_are_the_checked_qwen3_ones_with_the_image_plugin(name, text):
    # LlamaFactory registers them as its qwen3 and qwen3_nothink (tests/test_templates.py) with the Qwen3-VL plugin
    assert VISION_TEMPLATES[name] == dataclasses.replace(TEMPLATES[text], name=name, mm_plugin="qwen3_vl")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_vl")
    local_vl_model(directory)
    return directory


def test_a_local_qwen3_vl_reads_its_processor_file_and_its_loss_is_hfs_with_that_processor(qwen3_vl, tmp_path):
    """The reader's batch for a Qwen3-VL directory, as `hp train` builds it, gives HF's loss with the
    processor transformers builds from the same directory and M-RoPE positions from HF's own get_rope_index."""
    from types import SimpleNamespace

    from transformers import AutoConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hp.train.data.examples import model_vision

    tok = load_tokenizer(str(qwen3_vl))
    config = AutoConfig.from_pretrained(qwen3_vl)
    directory = dataset(tmp_path, RECORDS)
    vision = model_vision(SimpleNamespace(dataset="d", dataset_dir=directory, model_name_or_path=str(qwen3_vl)), tok)
    bounds = TINY_QWEN3_VL_PROCESSOR["size"]
    assert vision.spec == ImageSpec(patch_size=4, min_pixels=bounds["shortest_edge"], mean=(0.5,) * 3,
                                    max_pixels=bounds["longest_edge"], std=(0.5,) * 3, image_max_pixels=768 * 768)
    data = build_examples("d", directory, tok, template="qwen3_vl", cutoff_len=512, vision=vision)
    grids = [tuple(g) for e in data.examples for g in vision.grids(e.get("images", []), "")]
    assert grids == [(1, 10, 8), (1, 14, 16), (1, 10, 10)]  # w x h 16 x 24 grows to 32 x 40, 80 x 64 shrinks to 64 x 56
    batch = collate(data.examples, tok.pad_token_id, vision=data.vision)
    assert int((batch.input_ids == config.image_token_id).sum()) == sum(t * h * w // 4 for t, h, w in grids)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_vl)
    out = model(**batch.inputs())
    processor = Qwen2VLImageProcessorPil.from_pretrained(qwen3_vl)
    hf = processor(images=[Image.open(p) for e in data.examples for p in e.get("images", [])], return_tensors="pt")
    assert torch.equal(batch.pixel_values, hf["pixel_values"])
    assert_hf_loss_and_logits(model, batch, hf, config.image_token_id, out)


def test_image_max_pixels_is_llamafactorys_key_and_reaches_the_images(tmp_path):
    from types import SimpleNamespace

    from hp.train.config import validate
    from hp.train.data.examples import model_vision

    minimal = {"model_name_or_path": TINY_QWEN2_5_VL, "dataset": "quickstart_vl", "output_dir": "out"}
    assert validate(minimal).image_max_pixels == 768 * 768  # LlamaFactory's default
    with pytest.raises(ConfigError, match=r"image_max_pixels = 100: expected an integer >= 1024"):
        validate({**minimal, "image_max_pixels": 100})  # below image_min_pixels, which LlamaFactory refuses too
    config = SimpleNamespace(dataset="d", dataset_dir=dataset(tmp_path, RECORDS), model_name_or_path=TINY_QWEN2_5_VL,
                             image_max_pixels=40 * 40)
    vision = model_vision(config, TOK)
    assert vision.spec == dataclasses.replace(VISION.spec, image_max_pixels=40 * 40)
    # w x h 80 x 64 (grid 16 x 20 unbounded) shrinks to 44 x 35, which the processor grows to 64 x 56
    assert vision.grids([str(tmp_path / "pics" / "b.png")], "") == [(1, 14, 16)]


def assert_hf_loss_and_logits(model, batch, hf: dict, image_token_id: int, out) -> None:
    """`out` (the model on hp's batch) is HF's model on its processor's pixels, with its own M-RoPE positions."""
    types = (batch.input_ids == image_token_id).int()
    positions, _ = model.model.get_rope_index(batch.input_ids, types, image_grid_thw=hf["image_grid_thw"])
    want = model(input_ids=batch.input_ids, labels=batch.labels, pixel_values=hf["pixel_values"],
                 image_grid_thw=hf["image_grid_thw"], position_ids=positions)
    assert out.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert torch.allclose(out.logits, want.logits, atol=1e-6)


@pytest.mark.parametrize("frozen, placements", [
    (True, [(2, "auto", 1, 1)]),
    (False, [(1, 1, 1, 1), (1, "pp", 2, 1), (1, "pp", 1, 2)]),
], ids=["tower frozen where measured costs say", "tower trained on a rank of its own, in two replicas, and at tp=2"])
def test_a_placed_tower_has_the_plain_runs_losses_and_weights(tmp_path, frozen, placements):
    """`parallel.mpmd: {place: {vision: ...}}` (hp.mpmd's level 2) on two gloo workers against one plain worker:
    a frozen tower placed by the costs measured on the model before it is cut, on a Qwen2.5-VL directory saved
    by HF with its head tied to its embedding (in two stages when the pipeline spans both ranks: each copy
    gets both gradients); a trained one on a rank of its own (the language model's backward split:
    `zero_bubble`), two replicas of a one-rank placement each taking half of every batch's rows and images,
    and a one-rank placement laid out tp=2 with sequence parallel over two ranks (two planes). With
    two accumulated batches a step: the same losses step by step (the third step planned from the measured
    costs), and the same weights in the checkpoint (each rank saved its share under the model's own names);
    the trained placements also evaluate a held-out split (forward only, every replica the whole batch) to
    the plain run's eval loss."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from hp.train.checkpoint import load_model_weights

    rows = 4  # each batch's, shared by the replicas
    model_dir = tmp_path / "tied"
    if frozen:
        local_vl_model(model_dir, "qwen2_5_vl", {**TINY_QWEN3_VL_PROCESSOR, "processor_class": "Qwen2_5_VLProcessor"},
                       tied=True)
    run = ["max_steps=3", "save_steps=3", "logging_steps=1", f"per_device_train_batch_size={rows}",
           *([f"model_name_or_path={model_dir}"] if frozen else []),
           "gradient_accumulation_steps=2", "learning_rate=3e-3", "warmup_ratio=0",
           *(["val_size=0", "eval_strategy='no'"] if frozen else
             ["val_size=0.1", "eval_strategy=steps", "eval_steps=3", "per_device_eval_batch_size=4"]),
           f"freeze_vision_tower={frozen}", f"freeze_multi_modal_projector={frozen}",
           f"dataset_dir={ROOT / 'examples' / 'data'}", "parallel.tp=1"]
    plain = summary(hp_train(*run, f"output_dir={tmp_path / 'plain'}", config=QUICKSTART_VL))
    want = losses(tmp_path / "plain")
    config = AutoConfig.from_pretrained(tmp_path / "plain" / "checkpoint-3")
    weights = Qwen2_5_VLForConditionalGeneration(config)
    load_model_weights(str(tmp_path / "plain" / "checkpoint-3"), weights)
    for pp, place, dp, tp in placements:
        out = tmp_path / f"{place}-{dp}-{tp}"
        split = ", zero_bubble: true" if place == 1 else ""  # the language model's backward split
        placed = summary(hp_train(*run, f"parallel.pp={pp}", f"parallel.mpmd={{place: {{vision: {place}}}{split}}}",
                                  f"parallel.dp={dp}", f"per_device_train_batch_size={rows // dp}",
                                  f"parallel.tp={tp}", f"parallel.sp={tp > 1}", f"output_dir={out}",
                                  config=QUICKSTART_VL))
        summed = placed["mpmd_place"]
        assert summed["replicas"] == dp and summed["planned_from_costs"], placed
        assert placed["eval_loss"] is None if frozen else placed["eval_loss"] == pytest.approx(plain["eval_loss"],
                                                                                             rel=1e-5), placed
        if place == "auto":  # the pipeline over both ranks with the tower in its bubbles, or over one beside it
            chosen = summed["chosen"]
            assert chosen["where"] == min(chosen["predicted_step_s"], key=chosen["predicted_step_s"].get), chosen
            assert summed["programs"]["vision"] == ([0, 1] if chosen["where"] == "shared" else [1]), placed
        got = losses(out)
        assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), got
        model = Qwen2_5_VLForConditionalGeneration(config)
        load_model_weights(str(out / "checkpoint-3"), model)
        # AdamW moves a weight by about lr whatever its gradient's size, so where a gradient is near zero the
        # float noise of another order of sums moves it by a sizable share of lr (seen: 7e-5 at tp=2 with sp,
        # transformers 5.25); a wrong gradient moves it by lr: lr / 10
        for key, value in weights.state_dict().items():
            assert torch.allclose(model.state_dict()[key], value, rtol=1e-5, atol=3e-4), key


@pytest.mark.parametrize("overrides, words", [
    (["parallel.cp=2"], "parallel.cp = 2 with mpmd.place: a placed program's stages are laid out over tp alone"),
    (["parallel.pp_schedule=GPipe"], "parallel.pp_schedule = 'GPipe' with mpmd.place: the placed step orders"),
    (["parallel.mpmd={place: {audio: 1}}"], "parallel.mpmd.place.audio = 1: no sub-model hp train places"),
    (["parallel.mpmd={place: {vision: 0}}"], "parallel.mpmd.place.vision = 0: expected 'pp'"),
    (["parallel.mpmd={place: {vision: pp}, chunks: 2}"], "parallel.mpmd = {'place': {'vision': 'pp'}, 'chunks': 2}"),
    (["parallel.pp=1", "parallel.mpmd={place: {vision: 1}}", "freeze_vision_tower=true",
      "freeze_multi_modal_projector=true"], "its own ranks would have nothing to train"),
    (["nproc_per_node=3"], "pp + mpmd.place's own ranks = 2 + 0 = 2"),
    (["parallel.dp=2", "nproc_per_node=2"], "(pp + mpmd.place's own ranks) * dp = (2 + 0) * 2 = 4"),
    (["parallel.mpmd={place: {vision: auto}}", "parallel.pp_split=[1, 1]"],
     "parallel.pp_split = (1, 1) with mpmd.place.vision = 'auto': the pipeline's stages depend on the choice"),
], ids=["cp", "pp schedule", "unknown sub-model", "no ranks", "chunks too", "frozen on its own ranks", "ranks",
        "ranks of replicas", "auto with a split"])
def test_a_placement_that_cannot_run_is_named_before_any_worker(overrides, words):
    from hp.train.config import load_config

    placed = ["parallel.tp=1", "parallel.pp=2", "parallel.mpmd={place: {vision: pp}}", "val_size=0",
              "eval_strategy='no'"]
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(QUICKSTART_VL, [*placed, *overrides])


def test_placing_a_tower_needs_a_model_with_one():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="mpmd.place.vision = 'pp': llama has no vision tower to place"):
        Strategy(pp=2, mpmd_place={"vision": "pp"}).check_fits(LlamaConfig())

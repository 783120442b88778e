"""The examples a run trains on: the named datasets read, checked for their stage and tokenized.

Stage "sft" renders each record as a conversation with a chat template
(`hp.train.config.templates`; unset, the tokenizer's own chat_template, else
`empty`) and encodes it as LlamaFactory's supervised stage does
(`hp.train.data.encoding`): the same ids, every answer supervised (alpaca's
`history` included) and every prompt masked, `cutoff_len` shared between
prompt and answer turn by turn. LlamaFactory's `default_system`,
`train_on_prompt`, `mask_history`, `enable_thinking` and
`preserve_thinking` change that as they do there (`SFT_OPTIONS`; the two
supervision keys are refused in pt, as there). A template whose special
tokens the tokenizer lacks is refused. Stage "pt" trains on plain text
(`hp.train.data.records.pt_text`): each document ends with the template's
eos (llama3's `<|end_of_text|>`, as in LlamaFactory) and starts with the
tokenizer's bos when it has one, and all documents are packed back to back
into `cutoff_len` blocks (the last block may be shorter). Labels are
aligned with `input_ids` (HF causal LMs shift them); -100 marks tokens
without loss.

Stages rm and dpo read preference pairs from a `"ranking": true` entry, and
stage kto answers judged by a `kto_tag` column (`hp.train.data.records`);
`hp.train.data.preference` encodes both as LlamaFactory's pairwise and
feedback processors do. A ranking dataset is refused for pt, sft and kto, a
plain one for rm and dpo, a `kto_tag` column outside kto, and images in
preference data; `train_on_prompt` and `mask_history`, which LlamaFactory
ignores in these stages, are refused there so that nobody believes they
act.

Images (sft, for a vision-language model: `vision`, which `load_examples`
reads from the model config when a dataset has an images column) are read
as LlamaFactory's multimodal data: the template must place them
(`qwen2_vl`), each record must hold as many `<image>` placeholders in its
messages as images, and each placeholder becomes its image's tokens
(`hp.train.data.vision.Vision.tokens`), never supervised. Every image is
opened and sized while the data is read, so a missing or unreadable file, a
picture smaller than one patch, or a `cutoff_len` that would cut through an
image (refused: a cut image no longer matches its patches) is an error
naming the record before any worker starts; a text model, a template
without images, or stage pt given a dataset with images are refused by the
dataset's name. An example keeps its images' paths (`images`); a batch
reads and cuts them (`hp.train.data.batch`).

An sft, rm, dpo or kto example left with no supervised token (a tiny
`cutoff_len`; either answer of a pair, or a kto answer) is dropped and
counted in `Examples.dropped`, since it would only cost compute
(LlamaFactory keeps it); if every example is dropped the load fails.
Malformed data is a ValueError naming the dataset, file and record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hp.train.config import PAIRWISE_STAGES, PREFERENCE_STAGES, STAGES, TrainConfig
from hp.train.config.templates import VISION_TEMPLATES, Template
from hp.train.data.dataset_info import INFO_FILE, DatasetSpec, check_mapped_columns, dataset_specs, read_records
from hp.train.data.embedded import EMBEDDED, model_config
from hp.train.data.encoding import IGNORE_INDEX, check_supervision, document_end_id, template_for
from hp.train.data.preference import feedback_answer, keeps_supervision, kl_answers, sides
from hp.train.data.records import feedback_record
from hp.train.data.tokenizer import Tokenizer
from hp.train.data.tokenizing import Encoder, encode_all
from hp.train.data.vision import Vision

# LlamaFactory's data arguments that change the sft encoding, with its defaults (config keys of the same names).
SFT_OPTIONS: dict[str, Any] = {
    "default_system": None, "train_on_prompt": False, "mask_history": False, "enable_thinking": True,
    "preserve_thinking": False,
}


@dataclass
class Examples:
    """Tokenized examples and what loading left out.

    An example is a dict of `input_ids` and `labels` (and `images`' paths if
    any) for pt and sft, and of `hp.train.data.preference`'s shapes for rm, dpo
    and kto; `summary` counts the tokens and supervised labels of every side.

    >>> Examples([{"input_ids": [1, 2], "labels": [1, 2]}]).summary()
    '1 examples, 2 tokens, 2 supervised, 0 dropped'
    >>> pair = {"chosen_ids": [1, 2], "chosen_labels": [-100, 2], "rejected_ids": [1, 3], "rejected_labels": [-100, 3]}
    >>> Examples([pair]).summary()
    '1 examples, 4 tokens, 2 supervised, 0 dropped'
    """

    examples: list[dict[str, Any]]
    dropped: int = 0  # examples left with no supervised token
    vision: Vision | None = None  # how the model reads the examples' images; None: batches of text

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]

    def summary(self) -> str:
        runs = [side for e in self.examples for side in sides(e)]
        tokens = sum(len(ids) for ids, _ in runs)
        supervised = sum(sum(label != IGNORE_INDEX for label in labels) for _, labels in runs)
        images = sum(len(e.get("images", ())) for e in self.examples)
        shown = f", {images} images" if images else ""
        return (f"{len(self.examples)} examples, {tokens} tokens, {supervised} supervised, {self.dropped} dropped"
                f"{shown}")


def _check_takes_images(spec: DatasetSpec, stage: str, template: Template, vision: Vision | None) -> None:
    """A dataset with an images column needs sft, a template that places images and a model that reads them."""
    column = f"column {spec.columns['images']!r}"
    if stage in PREFERENCE_STAGES:
        raise ValueError(f"{spec.where()}: its records have images ({column}); hp train reads images in sft data "
                         f"only, not in preference data (stage {stage}): expected no images column in {INFO_FILE}, "
                         "or stage: sft")
    if vision is None:
        raise ValueError(
            f"{spec.where()}: its records have images ({column}), but the model is a text model, which reads none; "
            f"expected a vision-language model (model_name_or_path: hp/tiny-qwen2.5-vl) with template: "
            f"{', '.join(VISION_TEMPLATES)}, or no images column in {INFO_FILE}"
        )
    if stage != "sft":
        raise ValueError(f"{spec.where()}: its records have images ({column}), which stage {stage} does not read "
                         "(pt packs plain text); expected stage: sft")
    if template.mm_plugin is None:
        raise ValueError(
            f"{spec.where()}: its records have images ({column}), but template {template.name!r} places none "
            f"(LlamaFactory refuses images with it too); expected template: {', '.join(VISION_TEMPLATES)}"
        )


def _check_stage_reads(spec: DatasetSpec, stage: str) -> None:
    """The dataset holds what the stage trains on: chosen/rejected pairs for rm and dpo, tagged answers for kto."""
    ranked = f"\"ranking\": true in {INFO_FILE}"
    if spec.ranking and stage not in PAIRWISE_STAGES:
        wanted = ("a dataset without \"ranking\": true and with a kto_tag column, since kto reads one answer a record"
                  if stage == "kto" else f"stage: {' or '.join(PAIRWISE_STAGES)}, or a dataset without it")
        raise ValueError(f"{spec.where()}: a ranking dataset ({ranked}: chosen and rejected answers) is read by stages "
                         f"{' and '.join(PAIRWISE_STAGES)}, not {stage}; expected {wanted}")
    if stage in PAIRWISE_STAGES:
        if not spec.ranking:
            raise ValueError(f"{spec.where()}: stage {stage} trains on chosen and rejected answers, and this is not a "
                             f"ranking dataset; expected {ranked} and columns chosen and rejected in its entry")
        unmapped = [side for side in ("chosen", "rejected") if not spec.columns.get(side)]
        if unmapped:
            raise ValueError(f"{spec.where()}: a ranking dataset needs its {' and '.join(unmapped)} column named in "
                             f"{INFO_FILE}, as LlamaFactory gives neither a default (\"columns\": {{\"chosen\": "
                             "..., \"rejected\": ...}})")
    tagged = bool(spec.columns.get("kto_tag"))
    if stage == "kto" and not tagged:
        raise ValueError(f"{spec.where()}: stage kto trains on answers judged desirable or not; expected a kto_tag "
                         f"column (true or false) named in its {INFO_FILE} entry, e.g. \"columns\": "
                         "{\"kto_tag\": \"label\"}")
    if tagged and stage != "kto":
        raise ValueError(f"{spec.where()}: its kto_tag column ({spec.columns['kto_tag']!r}) is read by stage kto "
                         f"only, not {stage}; expected stage: kto, or no kto_tag in its columns")


def _check_sft_options(stage: str, train_on_prompt: bool, mask_history: bool) -> None:
    """train_on_prompt and mask_history shape sft's labels: refused elsewhere, where they would not act."""
    for key, value in (("train_on_prompt", train_on_prompt), ("mask_history", mask_history)):
        if stage == "pt" and value is True:
            raise ValueError(f"{key} = true with stage 'pt': pt supervises every token of its documents, and "
                             f"LlamaFactory takes train_on_prompt and mask_history in sft only; expected {key}: false, "
                             "or stage: sft")
        if stage in PREFERENCE_STAGES and value is True:
            raise ValueError(f"{key} = true with stage {stage!r}: {stage} supervises the final answer only, its "
                             f"prompt masked, and LlamaFactory ignores {key} there; hp train refuses it rather than "
                             f"ignore it: expected {key}: false, or stage: sft")


def _kl_partners(spec: DatasetSpec, records: list[dict[str, Any]]) -> list[str]:
    """Each kto record's KL answer (`kl_answers`), read here where all of a dataset's records are."""
    answers = [feedback_answer(feedback_record(r, spec, i)[0], where=spec.where(i)) for i, r in enumerate(records)]
    return kl_answers(answers)


def pack(documents: Sequence[list[int]], cutoff_len: int) -> list[dict[str, list[int]]]:
    """Token documents laid back to back and cut into `cutoff_len` blocks, all supervised.

    The last block keeps the remainder (shorter) rather than dropping it, so a
    small corpus still trains. Documents sharing a block attend to each other
    (no per-document mask; eos marks the boundary): plain packing, as in LlamaFactory's pt.

    >>> [b["input_ids"] for b in pack([[1, 2, 3], [4, 5]], 2)]
    [[1, 2], [3, 4], [5]]
    """
    stream = [t for doc in documents for t in doc]
    blocks = [stream[i : i + cutoff_len] for i in range(0, len(stream), cutoff_len)]
    return [{"input_ids": b, "labels": list(b)} for b in blocks]


def load_examples(config: Any, tokenizer: Tokenizer) -> Examples:
    """`build_examples` with the arguments a training config holds under LlamaFactory's key names.

    `config` needs `dataset`, `dataset_dir`, `stage`, `template`, `cutoff_len` and `max_samples`; the keys
    of `SFT_OPTIONS` that it lacks take LlamaFactory's defaults (a `TrainConfig` has them all).

    >>> from types import SimpleNamespace
    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> config = SimpleNamespace(dataset="quickstart", dataset_dir=Path(__file__).parents[3] / "examples" / "data",
    ...                          stage="pt", template="default", cutoff_len=256, max_samples=None)
    >>> len(load_examples(config, ByteTokenizer()))  # 2000 documents of 25 tokens, packed in 256s
    196
    """
    return build_examples(
        config.dataset, config.dataset_dir, tokenizer, stage=config.stage, template=config.template,
        cutoff_len=config.cutoff_len, max_samples=config.max_samples, **example_options(config, tokenizer),
    )


def example_options(config: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """The config's sft options, its preprocessing_num_workers and its model's Vision, as build_examples takes them."""
    options = {key: getattr(config, key, default) for key, default in SFT_OPTIONS.items()}
    return {**options, "workers": getattr(config, "preprocessing_num_workers", None),
            "vision": model_vision(config, tokenizer)}


def model_vision(config: Any, tokenizer: Tokenizer) -> Vision | None:
    """How the config's model reads images, when one of its datasets has an images column; else None (text).

    Text data never reads the model's config, so it loads as it always did. A local model's directory
    gives its processor's settings (`Vision.of`), and the config its `image_max_pixels` (LlamaFactory's
    default when it has none).

    >>> from types import SimpleNamespace
    >>> from hp.train.data.tokenizer import load_tokenizer
    >>> data_dir = Path(__file__).parents[3] / "examples" / "data"
    >>> config = SimpleNamespace(dataset="quickstart_vl", dataset_dir=data_dir, model_name_or_path="hp/tiny-qwen2.5-vl")
    >>> model_vision(config, load_tokenizer("hp/tiny-qwen2.5-vl")).spec.factor
    8
    """
    datasets = [name for name in (config.dataset, getattr(config, "eval_dataset", None)) if name]
    specs = [spec for name in datasets for spec in dataset_specs(name, config.dataset_dir)]
    model = getattr(config, "model_name_or_path", None)
    if model is None or not any(spec.columns.get("images") for spec in specs):
        return None
    directory = None if model in EMBEDDED else Path(model)
    return Vision.of(model_config(model, tokenizer.vocab_size), directory,
                     image_max_pixels=getattr(config, "image_max_pixels", TrainConfig.image_max_pixels))


def build_examples(
    dataset: str | Sequence[str],
    dataset_dir: str | Path,
    tokenizer: Tokenizer,
    *,
    stage: str = "sft",
    template: str | Template | None = None,
    cutoff_len: int = 1024,
    max_samples: int | None = None,
    default_system: str | None = None,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    enable_thinking: bool | None = True,
    preserve_thinking: bool = False,
    workers: int | None = None,
    vision: Vision | None = None,
) -> Examples:
    """Read, render and tokenize the named datasets (see the module docstring for the rules).

    `stage` pt packs documents, sft encodes conversations, rm and dpo
    chosen/rejected pairs and kto judged answers (`hp.train.data.preference`).

    `vision` is how the model reads images (`Vision.of` its config): a dataset
    with images needs one, and the examples carry it to their batches.

    `workers` > 1 tokenizes in that many forked processes (LlamaFactory's
    `preprocessing_num_workers`); the records keep their order, so the
    examples are the same.

    `max_samples` keeps the first that many records of each dataset; `template` None reads the
    tokenizer's chat_template, else uses `empty` (see `hp.train.data.encoding.get_template`). The
    keys of `SFT_OPTIONS` are LlamaFactory's (see `hp.train.data.encoding.configure` and
    `encode_conversation`).

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> data_dir = Path(__file__).parents[3] / "examples" / "data"  # the repository's quickstart data
    >>> data = build_examples("quickstart", data_dir, ByteTokenizer(), cutoff_len=64, max_samples=3)
    >>> data.summary()[:10]
    '3 examples'
    """
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {', '.join(STAGES)}")
    if cutoff_len < 1:
        raise ValueError(f"cutoff_len must be positive, got {cutoff_len}")
    _check_sft_options(stage, train_on_prompt, mask_history)
    tmpl = template_for(template, tokenizer, stage, default_system=default_system, enable_thinking=enable_thinking,
                        preserve_thinking=preserve_thinking)
    if stage == "sft":
        check_supervision(tmpl, train_on_prompt=train_on_prompt, mask_history=mask_history)
    end = document_end_id(tmpl, tokenizer) if stage == "pt" else None
    jobs = []
    for spec in dataset_specs(dataset, dataset_dir):
        _check_stage_reads(spec, stage)
        records = read_records(spec)[:max_samples]
        check_mapped_columns(spec, records)
        if spec.columns.get("images"):
            _check_takes_images(spec, stage, tmpl, vision)
        partners = _kl_partners(spec, records) if stage == "kto" else [""] * len(records)
        jobs += [(spec, i, record, kl) for i, (record, kl) in enumerate(zip(records, partners))]
    encoder = Encoder(tokenizer, tmpl, stage, cutoff_len, end, train_on_prompt, mask_history,
                      vision if tmpl.mm_plugin else None)
    encoded = encode_all(encoder, jobs, workers or 1)
    if stage == "pt":
        examples, dropped = pack(encoded, cutoff_len), 0
    else:
        # an example with nothing to learn (an empty answer, or no room left for one) would only cost
        examples = [e for e in encoded if keeps_supervision(e)]
        dropped = len(encoded) - len(examples)
    if not examples:
        raise ValueError(
            f"dataset {dataset!r}: no example left: none of the {dropped} examples keeps a supervised token within "
            f"cutoff_len={cutoff_len} (empty answers, or too small a cutoff_len)"
        )
    return Examples(examples, dropped, vision)

"""The data layer of `hp train`: LlamaFactory-style datasets, tokenized, and a resumable batch stream.

Users arrive with LlamaFactory configs and data directories, so the same
keys mean the same here: `dataset` is a comma-separated list of names,
looked up in `dataset_dir/dataset_info.json`, whose entries give
`file_name`, `formatting` ("alpaca", the default, or "sharegpt"), and
optionally `columns` and (sharegpt) `tags` renaming the record keys:

    alpaca   columns prompt (instruction), query (input), response (output),
             system, history (both unset by default)
    sharegpt columns messages (conversations), system, tools;
             tags role_tag (from), content_tag (value), user_tag (human),
             assistant_tag (gpt), observation_tag (observation),
             function_tag (function_call), system_tag (system)

Both formattings take LlamaFactory's `images` column too: a record's image
files (a list of paths, or one path, relative to `dataset_dir`, which is
LlamaFactory's default `media_dir`), each placed where an `<image>` stands
in the record's messages (see "Images" below).

Without a `dataset_info.json`, a name may instead be a `.json` or `.jsonl`
file path relative to `dataset_dir`, read as alpaca with default columns.
Only local `.json` (a list of objects) and `.jsonl` (one object a line) files
are read: nothing is downloaded, so hub-only entries are refused. Datasets
are concatenated in the order named; `tools` is read and ignored.

Stage "sft" renders each record as a conversation with a chat template
(`hp.train.templates`; unset, the tokenizer's own chat_template, else
`empty`) and encodes it as LlamaFactory's supervised stage does
(`hp.train.encoding`): the same ids, every answer supervised (alpaca's
`history` included) and every prompt masked, `cutoff_len` shared between
prompt and answer turn by turn. LlamaFactory's `default_system`,
`train_on_prompt`, `mask_history`, `enable_thinking` and
`preserve_thinking` change that as they do there (`SFT_OPTIONS`; the two
supervision keys are refused in pt, as there). A template whose special
tokens the tokenizer lacks is refused. Stage "pt" trains on plain text: an alpaca record
gives its prompt, query and response columns that are present, joined by
newlines (so `"columns": {"prompt": "text"}` reads a `text` column, as in
LlamaFactory), or, lacking the prompt column, its `text` key; each
document ends with the template's eos (llama3's `<|end_of_text|>`, as in
LlamaFactory) and starts with the tokenizer's bos when it has one, and all
documents are packed back to back into `cutoff_len` blocks (the last block
may be shorter); sharegpt is refused for pt, as in LlamaFactory. Labels are
aligned with `input_ids` (HF causal LMs shift them); -100 marks tokens
without loss.

Stages rm and dpo read preference pairs from a `"ranking": true` entry
whose `columns` name `chosen` and `rejected` (none by default, as in
LlamaFactory): in alpaca, the two answers' strings, after the prompt, query,
system and history columns (no response column); in sharegpt, one message
object each, read with the dataset's tags (an assistant or function_call
role), answering messages that end with the user's turn. Stage kto reads
one answer a record (alpaca's response, sharegpt's last message) judged by
the bool column `kto_tag` (true: desirable). `hp.train.preference_data`
encodes both as LlamaFactory's pairwise and feedback processors do. A
ranking dataset is refused for pt, sft and kto, a plain one for rm and dpo,
a `kto_tag` column outside kto, and images in preference data;
`train_on_prompt` and `mask_history`, which LlamaFactory ignores in these
stages, are refused there so that nobody believes they act.

Images (sft, for a vision-language model: `vision`, which `load_examples`
reads from the model config when a dataset has an images column) are read
as LlamaFactory's multimodal data: the template must place them
(`qwen2_vl`), each record must hold as many `<image>` placeholders in its
messages as images, and each placeholder becomes its image's tokens
(`hp.train.vision.Vision.tokens`), never supervised. Every image is opened
and sized while the data is read, so a missing or unreadable file, a picture
smaller than one patch, or a `cutoff_len` that would cut through an image
(refused: a cut image no longer matches its patches) is an error naming the
record before any worker starts; a text model, a template without images,
or stage pt given a dataset with images are refused by the dataset's name.
An example keeps its images' paths (`images`); a batch reads and cuts them
(`hp.train.batch`).

An sft, rm, dpo or kto example left with no supervised token (a tiny
`cutoff_len`; either answer of a pair, or a kto answer) is dropped and
counted in `Examples.dropped`, since it would only cost compute
(LlamaFactory keeps it); if every example is dropped the load fails.
Malformed data (unknown names, missing files or columns, bad JSON, a
conversation whose roles do not alternate) is a ValueError naming the
dataset, file and record: training on silently skipped data hides
configuration mistakes.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hp.train.batch import Batch, collate
from hp.train.config import PAIRWISE_STAGES, PREFERENCE_STAGES, STAGES
from hp.train.encoding import (  # noqa: F401 - encode_prompt and get_template are re-exported for callers
    IGNORE_INDEX, Conversation, check_supervision, document_end_id, encode_conversation, encode_prompt, get_template,
    template_for,
)
from hp.train.preference_data import (
    feedback_answer, feedback_example, keeps_supervision, kl_answers, pairwise_example, sides,
)
from hp.train.templates import IMAGE_PLACEHOLDER, TEMPLATES, VISION_TEMPLATES, Template  # noqa: F401 - re-exported
from hp.train.tokenizer import Tokenizer
from hp.train.vision import Vision

FORMATTINGS = ("alpaca", "sharegpt")
INFO_FILE = "dataset_info.json"

# LlamaFactory's defaults; None means "no such column unless mapped".
PREFERENCE_COLUMNS: dict[str, str | None] = {"chosen": None, "rejected": None, "kto_tag": None}
ALPACA_COLUMNS: dict[str, str | None] = {
    "prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None, "images": None,
    **PREFERENCE_COLUMNS,
}
SHAREGPT_COLUMNS: dict[str, str | None] = {
    "messages": "conversations", "system": None, "tools": None, "images": None, **PREFERENCE_COLUMNS,
}
# LlamaFactory's data arguments that change the sft encoding, with its defaults (config keys of the same names).
SFT_OPTIONS: dict[str, Any] = {
    "default_system": None, "train_on_prompt": False, "mask_history": False, "enable_thinking": True,
    "preserve_thinking": False,
}
SHAREGPT_TAGS: dict[str, str] = {
    "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system",
}


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset_info.json entry, resolved: where the file is and how its records read."""

    name: str
    file: Path
    formatting: str = "alpaca"
    columns: Mapping[str, str | None] = field(default_factory=lambda: dict(ALPACA_COLUMNS))
    tags: Mapping[str, str] = field(default_factory=lambda: dict(SHAREGPT_TAGS))
    mapped: frozenset[str] = frozenset()  # column roles that dataset_info.json named explicitly
    media_dir: Path | None = None  # where image paths start: dataset_dir (LlamaFactory's default); None: the file's
    ranking: bool = False  # its records hold chosen/rejected pairs (stages rm, dpo)

    def image_path(self, name: str) -> str:
        """The path of an image the records name (relative to `media_dir`, or absolute).

        >>> DatasetSpec("d", Path("data/d.json")).image_path("pics/1.png")
        'data/pics/1.png'
        """
        return str((self.media_dir if self.media_dir is not None else self.file.parent) / name)

    def where(self, index: int | None = None) -> str:
        """`dataset 'name' (file)`, with the record number when given: the prefix of every error."""
        at = f", record {index}" if index is not None else ""
        return f"dataset {self.name!r} ({self.file}{at})"


@dataclass
class Examples:
    """Tokenized examples and what loading left out.

    An example is a dict of `input_ids` and `labels` (and `images`' paths if
    any) for pt and sft, and of `hp.train.preference_data`'s shapes for rm, dpo
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


# ---------------------------------------------------------------- finding files


def dataset_specs(dataset: str | Sequence[str], dataset_dir: str | Path) -> list[DatasetSpec]:
    """The datasets named by `dataset` (comma-separated), resolved against `dataset_dir`.

    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}))
    >>> _ = (d / "mine.json").write_text("[]")
    >>> [s.formatting for s in dataset_specs("mine", d)]
    ['alpaca']
    """
    names = [n.strip() for n in (dataset.split(",") if isinstance(dataset, str) else dataset)]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no dataset named: `dataset` is {dataset!r}; give one or more names, comma-separated")
    directory = Path(dataset_dir)
    info_path = directory / INFO_FILE
    if not info_path.is_file():
        return [_bare_file_spec(name, directory) for name in names]
    info = _read_json(info_path, f"{INFO_FILE} in {directory}")
    if not isinstance(info, dict):
        raise ValueError(f"{info_path}: expected an object mapping dataset names to entries, got {type(info).__name__}")
    return [_spec_from_info(name, info, directory, info_path) for name in names]


def _bare_file_spec(name: str, directory: Path) -> DatasetSpec:
    path = directory / name
    if not path.is_file():
        raise ValueError(
            f"dataset {name!r}: {directory} has no {INFO_FILE} and no file {path} "
            f"(name a .json/.jsonl file in dataset_dir, or add {INFO_FILE})"
        )
    return DatasetSpec(name, path, media_dir=directory)


def _spec_from_info(name: str, info: Mapping[str, Any], directory: Path, info_path: Path) -> DatasetSpec:
    if name not in info:
        raise ValueError(f"dataset {name!r} is not in {info_path}; known: {', '.join(sorted(info)) or '(none)'}")
    entry = info[name]
    where = f"dataset {name!r} in {info_path}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise ValueError(f"{where}: ranking must be true or false, got {ranking!r}")
    if "file_name" not in entry:
        hub = [k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name") if k in entry]
        why = f"it names only {', '.join(hub)}, and hp downloads nothing" if hub else "it has no file_name"
        raise ValueError(f"{where}: {why}; put the data in a local file and set file_name")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise ValueError(f"{where}: formatting {formatting!r} is not one of {', '.join(FORMATTINGS)}")
    defaults = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    columns = _overrides(entry.get("columns", {}), defaults, f"{where}: columns")
    tags = _overrides(entry.get("tags", {}), SHAREGPT_TAGS, f"{where}: tags")
    if formatting == "alpaca" and "tags" in entry:
        raise ValueError(f"{where}: tags apply to the sharegpt formatting only")
    path = directory / entry["file_name"]
    if not path.is_file():
        raise ValueError(f"dataset {name!r}: file {path} does not exist (file_name in {info_path})")
    mapped = frozenset(entry.get("columns", {}))
    return DatasetSpec(name, path, formatting, columns, tags, mapped, media_dir=directory, ranking=ranking)


def _overrides(given: Any, defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`defaults` updated by `given`, refusing keys that mean nothing here (typos, unsupported features)."""
    if not isinstance(given, dict):
        raise ValueError(f"{where} must be an object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(defaults)}")
    return {**defaults, **given}


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: bad JSON in {path} at line {e.lineno} column {e.colno}: {e.msg}") from e


def read_records(spec: DatasetSpec) -> list[dict[str, Any]]:
    """The records (JSON objects) of `spec`'s file: a .json list or .jsonl lines.

    >>> import pathlib, tempfile
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
    >>> _ = f.write_text('{"instruction": "hi", "output": "yo"}\\n')
    >>> read_records(DatasetSpec("a", f))
    [{'instruction': 'hi', 'output': 'yo'}]
    """
    suffix = spec.file.suffix.lower()
    if suffix == ".jsonl":
        records = _read_jsonl(spec)
    elif suffix == ".json":
        records = _read_json(spec.file, f"dataset {spec.name!r}")
        if not isinstance(records, list):
            raise ValueError(f"{spec.where()}: expected a JSON list of records, got {type(records).__name__}")
    else:
        raise ValueError(f"{spec.where()}: only .json and .jsonl files are read, not {suffix or 'no suffix'}")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{spec.where(i)}: expected an object, got {type(record).__name__}")
    if not records:
        raise ValueError(f"{spec.where()}: the file holds no records")
    return records


def _read_jsonl(spec: DatasetSpec) -> list[Any]:
    records = []
    with open(spec.file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # a trailing blank line is common and harmless
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"dataset {spec.name!r}: bad JSON in {spec.file} at line {lineno} column {e.colno}: {e.msg}"
                ) from e
    return records


# ---------------------------------------------------------------- records -> conversations and texts


def _column(record: Mapping[str, Any], spec: DatasetSpec, role: str, index: int, *, required: bool) -> Any:
    """The value of the column playing `role`, or None when the column is absent and optional."""
    key = spec.columns.get(role)
    if key is None:
        return None
    if key not in record:
        if required:
            raise ValueError(
                f"{spec.where(index)}: no column {key!r} (the {role}); the record has {', '.join(map(repr, record))}"
            )
        return None
    return record[key]


def _text(value: Any, spec: DatasetSpec, what: str, index: int) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{spec.where(index)}: {what} must be a string, got {type(value).__name__}")
    return value


def alpaca_conversation(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> Conversation:
    """An alpaca record as a conversation: history pairs, then prompt (+ newline + query) and response.

    >>> alpaca_conversation({"instruction": "add", "input": "1 2", "output": "3"}, DatasetSpec("d", Path("d.json")))
    Conversation(turns=[('user', 'add\\n1 2'), ('assistant', '3')], system='')
    """
    asked = _alpaca_prompt(record, spec, index)
    response = _text(_column(record, spec, "response", index, required=True), spec, "the response", index)
    return Conversation([*asked.turns, ("assistant", response)], asked.system)


def _alpaca_prompt(record: Mapping[str, Any], spec: DatasetSpec, index: int) -> Conversation:
    """An alpaca record's conversation up to its answer: history pairs, then prompt (+ newline + query)."""
    prompt = _text(_column(record, spec, "prompt", index, required=True), spec, "the prompt", index)
    query = _text(_column(record, spec, "query", index, required=False), spec, "the query", index)
    system = _text(_column(record, spec, "system", index, required=False), spec, "the system prompt", index)
    turns: list[tuple[str, str]] = []
    for pair in _column(record, spec, "history", index, required=False) or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise ValueError(f"{spec.where(index)}: history must be a list of [prompt, response] string pairs")
        turns += [("user", pair[0]), ("assistant", pair[1])]
    turns.append(("user", f"{prompt}\n{query}" if query else prompt))
    return Conversation(turns, system)


def sharegpt_conversation(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> Conversation:
    """A sharegpt record as a conversation; observation turns count as user, function calls as assistant.

    >>> spec = DatasetSpec("d", Path("d.json"), "sharegpt", SHAREGPT_COLUMNS)
    >>> msgs = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    >>> sharegpt_conversation({"conversations": msgs}, spec).turns
    [('user', 'hi'), ('assistant', 'hello')]
    """
    messages = _column(record, spec, "messages", index, required=True)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{spec.where(index)}: {spec.columns['messages']!r} must be a non-empty list of messages")
    tags = spec.tags
    side = {tags["user_tag"]: "user", tags["observation_tag"]: "user",
            tags["assistant_tag"]: "assistant", tags["function_tag"]: "assistant"}
    system = _text(_column(record, spec, "system", index, required=False), spec, "the system prompt", index)
    if isinstance(messages[0], dict) and messages[0].get(tags["role_tag"]) == tags["system_tag"]:
        system = _text(messages[0].get(tags["content_tag"]), spec, "the system message", index)
        messages = messages[1:]  # a leading system message overrides the system column
    turns = []
    for k, message in enumerate(messages):
        role, content = _message(message, spec, index, f"message {k}")
        want = "user" if k % 2 == 0 else "assistant"
        if side.get(role) != want:
            allowed = [t for t, s in side.items() if s == want]
            raise ValueError(
                f"{spec.where(index)}: message {k} has {tags['role_tag']}={role!r}, expected one of "
                f"{', '.join(map(repr, allowed))} (turns alternate user, assistant, starting with the user)"
            )
        turns.append((want, content))
    return Conversation(turns, system)


def _message(message: Any, spec: DatasetSpec, index: int, what: str) -> tuple[Any, str]:
    """(role, content) of a sharegpt message; `what` names it in errors ("message 3")."""
    role_tag, content_tag = spec.tags["role_tag"], spec.tags["content_tag"]
    if not isinstance(message, dict) or role_tag not in message or content_tag not in message:
        raise ValueError(
            f"{spec.where(index)}: {what} must be an object with keys {role_tag!r} and {content_tag!r} "
            f"(set tags.role_tag / tags.content_tag in {INFO_FILE} if yours differ)"
        )
    return message[role_tag], _text(message[content_tag], spec, f"{what}'s content", index)


def pairwise_record(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> tuple[Conversation, str, str]:
    """A ranking record (stages rm, dpo): its conversation up to the answer, and the chosen and rejected answers.

    >>> columns = {**ALPACA_COLUMNS, "chosen": "good", "rejected": "bad"}
    >>> spec = DatasetSpec("d", Path("d.json"), columns=columns, ranking=True)
    >>> pairwise_record({"instruction": "1+1", "good": "2", "bad": "3"}, spec)
    (Conversation(turns=[('user', '1+1')], system=''), '2', '3')
    """
    if spec.formatting == "alpaca":
        conv = _alpaca_prompt(record, spec, index)
        chosen, rejected = (_answer_text(record, spec, side, index) for side in ("chosen", "rejected"))
    else:
        conv = sharegpt_conversation(record, spec, index)
        chosen, rejected = (_answer_message(record, spec, side, index) for side in ("chosen", "rejected"))
    return conv, chosen, rejected


def _answer_text(record: Mapping[str, Any], spec: DatasetSpec, side: str, index: int) -> str:
    value = _column(record, spec, side, index, required=True)
    if not isinstance(value, str):
        raise ValueError(f"{spec.where(index)}: column {spec.columns[side]!r} (the {side} answer) must be a string, "
                         f"got {type(value).__name__}")
    return value


def _answer_message(record: Mapping[str, Any], spec: DatasetSpec, side: str, index: int) -> str:
    """The content of a sharegpt ranking record's chosen or rejected message, which must be an answer's."""
    what = f"the {side} message (column {spec.columns[side]!r})"
    role, content = _message(_column(record, spec, side, index, required=True), spec, index, what)
    answers = (spec.tags["assistant_tag"], spec.tags["function_tag"])
    if role not in answers:
        raise ValueError(f"{spec.where(index)}: {what} has {spec.tags['role_tag']}={role!r}, expected one of "
                         f"{', '.join(map(repr, answers))} (an answer to the conversation's last user turn)")
    return content


def feedback_record(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> tuple[Conversation, bool]:
    """A kto record: its conversation (the judged answer last) and its kto_tag (True: desirable).

    >>> spec = DatasetSpec("d", Path("d.json"), columns={**ALPACA_COLUMNS, "kto_tag": "label"})
    >>> feedback_record({"instruction": "1+1", "output": "3", "label": False}, spec)
    (Conversation(turns=[('user', '1+1'), ('assistant', '3')], system=''), False)
    """
    read = alpaca_conversation if spec.formatting == "alpaca" else sharegpt_conversation
    conv = read(record, spec, index)
    tag = _column(record, spec, "kto_tag", index, required=True)
    if not isinstance(tag, bool):
        raise ValueError(f"{spec.where(index)}: column {spec.columns['kto_tag']!r} (the kto_tag) must be true or "
                         f"false, got {tag!r}")
    return conv, tag


def pt_text(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> str:
    """The document a pretraining record holds (see the module docstring for which column).

    >>> pt_text({"text": "once upon a time"}, DatasetSpec("d", Path("d.json")))
    'once upon a time'
    """
    if spec.formatting != "alpaca":
        raise ValueError(f"{spec.where()}: stage pt reads plain text; the sharegpt formatting is for sft")
    if spec.columns["prompt"] not in record:
        if "text" in record:
            return _text(record["text"], spec, "'text'", index)
        raise ValueError(
            f"{spec.where(index)}: no column 'text' nor {spec.columns['prompt']!r} (the prompt); "
            f"the record has {', '.join(map(repr, record))}"
        )
    parts = [_column(record, spec, role, index, required=False) for role in ("prompt", "query", "response")]
    return "\n".join(_text(p, spec, "a text column", index) for p in parts if p)


def record_images(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> list[str]:
    """The paths of the images a record names in its images column (none when it has no such column or value).

    >>> spec = DatasetSpec("d", Path("data/d.json"), "sharegpt", {**SHAREGPT_COLUMNS, "images": "images"})
    >>> record_images({"images": ["a.png", "b.png"]}, spec)
    ['data/a.png', 'data/b.png']
    """
    value = _column(record, spec, "images", index, required=False)
    names = [value] if isinstance(value, str) else value or []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError(f"{spec.where(index)}: {spec.columns['images']!r} must be a list of image file paths "
                         f"(relative to dataset_dir), got {value!r}")
    return [spec.image_path(name) for name in names]


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


# ---------------------------------------------------------------- tokens


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
    >>> from hp.train.tokenizer import ByteTokenizer
    >>> config = SimpleNamespace(dataset="quickstart", dataset_dir=Path(__file__).parents[2] / "examples" / "data",
    ...                          stage="pt", template="default", cutoff_len=256, max_samples=None)
    >>> len(load_examples(config, ByteTokenizer()))  # 2000 documents of 25 tokens, packed in 256s
    196
    """
    return build_examples(
        config.dataset, config.dataset_dir, tokenizer, stage=config.stage, template=config.template,
        cutoff_len=config.cutoff_len, max_samples=config.max_samples, **_options(config, tokenizer),
    )


def _options(config: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """The config's sft options, its preprocessing_num_workers and its model's Vision, as build_examples takes them."""
    options = {key: getattr(config, key, default) for key, default in SFT_OPTIONS.items()}
    return {**options, "workers": getattr(config, "preprocessing_num_workers", None),
            "vision": model_vision(config, tokenizer)}


def model_vision(config: Any, tokenizer: Tokenizer) -> Vision | None:
    """How the config's model reads images, when one of its datasets has an images column; else None (text).

    Text data never reads the model's config, so it loads as it always did.

    >>> from types import SimpleNamespace
    >>> from hp.train.tokenizer import load_tokenizer
    >>> data_dir = Path(__file__).parents[2] / "examples" / "data"
    >>> config = SimpleNamespace(dataset="quickstart_vl", dataset_dir=data_dir, model_name_or_path="hp/tiny-qwen2.5-vl")
    >>> model_vision(config, load_tokenizer("hp/tiny-qwen2.5-vl")).spec.factor
    8
    """
    datasets = [name for name in (config.dataset, getattr(config, "eval_dataset", None)) if name]
    specs = [spec for name in datasets for spec in dataset_specs(name, config.dataset_dir)]
    model = getattr(config, "model_name_or_path", None)
    if model is None or not any(spec.columns.get("images") for spec in specs):
        return None
    from hp.train.model import model_config

    return Vision.of(model_config(model, tokenizer.vocab_size))


def load_splits(config: Any, tokenizer: Tokenizer) -> tuple[Examples, Examples | None]:
    """(training examples, evaluation examples or None) as the config's val_size / eval_dataset say.

    `eval_dataset` names datasets read like `dataset`; else a `val_size` > 0 holds out a seeded
    random part of the training examples (after packing, for pt), as LlamaFactory's split does.

    >>> from types import SimpleNamespace
    >>> from hp.train.tokenizer import ByteTokenizer
    >>> config = SimpleNamespace(dataset="quickstart", dataset_dir=Path(__file__).parents[2] / "examples" / "data",
    ...                          stage="sft", template="default", cutoff_len=64, max_samples=100, val_size=0.1,
    ...                          eval_dataset=None, seed=0)
    >>> train, held = load_splits(config, ByteTokenizer())
    >>> len(train), len(held)
    (90, 10)
    """
    examples = load_examples(config, tokenizer)
    if config.eval_dataset:
        held = build_examples(config.eval_dataset, config.dataset_dir, tokenizer, stage=config.stage,
                              template=config.template, cutoff_len=config.cutoff_len, max_samples=config.max_samples,
                              **_options(config, tokenizer))
        return examples, held
    if config.val_size:
        return split_for_eval(examples, config.val_size, config.seed)
    return examples, None


def split_for_eval(examples: Examples, val_size: float, seed: int) -> tuple[Examples, Examples]:
    """(rest, held out): `val_size` (a fraction in (0, 1), or a count) of the examples drawn with `seed`.

    >>> data = Examples([{"input_ids": [i], "labels": [i]} for i in range(10)])
    >>> [len(part) for part in split_for_eval(data, 0.2, seed=0)]
    [8, 2]
    """
    n = len(examples)
    held = round(val_size * n) if val_size < 1 else int(val_size)
    if not 0 < held < n:
        raise ValueError(f"val_size = {val_size:g} holds out {held} of the {n} training examples: expected at least "
                         "one for evaluation and one left for training")
    order = list(range(n))
    random.Random(f"hp.train.data:eval:{seed}").shuffle(order)
    chosen = set(order[:held])
    rest = [e for i, e in enumerate(examples.examples) if i not in chosen]
    held_out = [e for i, e in enumerate(examples.examples) if i in chosen]
    return Examples(rest, examples.dropped, examples.vision), Examples(held_out, vision=examples.vision)


def eval_batches(examples: Examples, batch_size: int, pad_id: int) -> list[Batch]:
    """Every example once, in order, `batch_size` rows a batch; the last is filled with rows without loss.

    >>> data = Examples([{"input_ids": [1, 2], "labels": [1, 2]}] * 3)
    >>> [labels.tolist() for _, labels in eval_batches(data, 2, pad_id=0)][1]
    [[1, 2], [-100, -100]]
    """
    rows = list(examples.examples)
    rows += [{"input_ids": [pad_id], "labels": [IGNORE_INDEX]}] * (-len(rows) % batch_size)
    return [collate(rows[i : i + batch_size], pad_id, vision=examples.vision) for i in range(0, len(rows), batch_size)]


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
    chosen/rejected pairs and kto judged answers (`hp.train.preference_data`).

    `vision` is how the model reads images (`Vision.of` its config): a dataset
    with images needs one, and the examples carry it to their batches.

    `workers` > 1 tokenizes in that many forked processes (LlamaFactory's
    `preprocessing_num_workers`); the records keep their order, so the
    examples are the same.

    `max_samples` keeps the first that many records of each dataset; `template` None reads the
    tokenizer's chat_template, else uses `empty` (see `hp.train.encoding.get_template`). The
    keys of `SFT_OPTIONS` are LlamaFactory's (see `hp.train.encoding.configure` and
    `encode_conversation`).

    >>> from hp.train.tokenizer import ByteTokenizer
    >>> data_dir = Path(__file__).parents[2] / "examples" / "data"  # the repository's quickstart data
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
        _check_mapped_columns(spec, records)
        if spec.columns.get("images"):
            _check_takes_images(spec, stage, tmpl, vision)
        partners = _kl_partners(spec, records) if stage == "kto" else [""] * len(records)
        jobs += [(spec, i, record, kl) for i, (record, kl) in enumerate(zip(records, partners))]
    encoder = _Encoder(tokenizer, tmpl, stage, cutoff_len, end, train_on_prompt, mask_history,
                       vision if tmpl.mm_plugin else None)
    encoded = _encode_all(encoder, jobs, workers or 1)
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


# A record to encode: its dataset, index and record, and the answer of its KL example (kto; else "").
_Job = tuple[DatasetSpec, int, dict[str, Any], str]


@dataclass(frozen=True)
class _Encoder:
    """One record (a `_Job`) to its document (pt) or example (sft: ids, labels, images; rm, dpo, kto)."""

    tokenizer: Tokenizer
    template: Template
    stage: str
    cutoff_len: int
    end: int | None
    train_on_prompt: bool
    mask_history: bool
    vision: Vision | None = None  # set when the template places images

    def __call__(self, job: _Job) -> Any:
        spec, i, record, kl_answer = job
        if self.stage == "pt":
            return _document(pt_text(record, spec, i), self.tokenizer, self.end)
        if self.stage in PREFERENCE_STAGES:
            return self._preference(spec, i, record, kl_answer)
        read = alpaca_conversation if spec.formatting == "alpaca" else sharegpt_conversation
        conv = read(record, spec, i)
        if conv.turns[-1][0] != "assistant":
            raise ValueError(f"{spec.where(i)}: the conversation ends with a user turn; sft needs a response last")
        if self.vision is not None:
            return self._with_images(conv, spec, i, record, self.vision)
        ids, labels = self._encode(conv)
        return {"input_ids": ids, "labels": labels}

    def _preference(self, spec: DatasetSpec, i: int, record: dict[str, Any], kl_answer: str) -> dict[str, Any]:
        """The rm/dpo pair or the kto example (with its KL side) of a record."""
        where = spec.where(i)
        if self.stage in PAIRWISE_STAGES:
            conv, chosen, rejected = pairwise_record(record, spec, i)
            return pairwise_example(conv, chosen, rejected, self.tokenizer, self.template, self.cutoff_len,
                                    where=where)
        conv, desirable = feedback_record(record, spec, i)
        return feedback_example(conv, kl_answer, desirable, self.tokenizer, self.template, self.cutoff_len,
                                where=where)

    def _encode(self, conv: Conversation, images: Sequence[list[int]] = (), *,
                whole: bool = False) -> tuple[list[int], list[int]]:
        """(ids, labels) of `conv`, cut to cutoff_len unless `whole`."""
        return encode_conversation(conv, self.tokenizer, self.template, None if whole else self.cutoff_len,
                                   train_on_prompt=self.train_on_prompt, mask_history=self.mask_history, images=images)

    def _with_images(self, conv: Conversation, spec: DatasetSpec, i: int, record: dict[str, Any],
                     vision: Vision) -> dict[str, list]:
        """The example of a record that may hold images: each `<image>` its image's tokens, none supervised."""
        where = spec.where(i)
        paths = record_images(record, spec, i)
        placeholders = sum(content.count(IMAGE_PLACEHOLDER) for _, content in conv.turns)
        if placeholders != len(paths):
            column = (f"its column {spec.columns['images']!r} names {len(paths)}" if spec.columns.get("images")
                      else f"the dataset has no images column in {INFO_FILE}, so it has {len(paths)}")
            raise ValueError(f"{where}: its messages hold {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) and "
                             f"{column} image(s); each image goes where an {IMAGE_PLACEHOLDER} stands, so the two "
                             "counts must be equal")
        runs = [vision.tokens(grid) for grid in vision.grids(paths, where)]
        ids, labels = self._encode(conv, runs)
        wanted = sum(len(run) - 2 for run in runs)
        found = ids.count(vision.image_token_id)
        if found > wanted:
            raise ValueError(f"{where}: its text spells the image token (id {vision.image_token_id}) itself, which "
                             "would take the place of an image's patches; expected it only where <image> is")
        if found < wanted:
            whole = len(self._encode(conv, runs, whole=True)[0])
            raise ValueError(
                f"{where}: cutoff_len = {self.cutoff_len} cuts through its images ({len(runs)} image(s) of {wanted} "
                f"image tokens in a conversation of {whole} tokens); hp train does not cut an image, whose tokens "
                f"must match its patches: expected cutoff_len >= {whole}, or smaller images"
            )
        example = {"input_ids": ids, "labels": vision.unsupervised(ids, labels)}
        return {**example, "images": paths} if paths else example


_WORKER_ENCODER: _Encoder | None = None  # what a tokenizing process was started with


def _start_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(job: _Job) -> Any:
    return _WORKER_ENCODER(job)


def _encode_all(encoder: _Encoder, jobs: list, workers: int) -> list:
    """`encoder` over `jobs` in order, in `workers` processes when more than one (and worth it).

    The processes come from a fork server, not from a fork of this process: by now this
    process may run threads (a process group's, a tokenizer's) that hold locks a forked child
    would wait on forever or die over. And they run in a process pool executor, which raises
    when a worker dies (`BrokenProcessPool`), where `multiprocessing.Pool.map` waits forever.
    """
    workers = min(workers, len(jobs) // 16)  # a process per handful of records costs more than it saves
    if workers <= 1:
        return [encoder(job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per worker is the parallelism
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hp.train.data"])  # imported once by the server, not by each worker
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)) as pool:
        return list(pool.map(_encode_in_worker, jobs, chunksize=max(1, len(jobs) // (4 * workers))))


def _check_mapped_columns(spec: DatasetSpec, records: list[dict[str, Any]]) -> None:
    """A column that dataset_info.json names but no record has is a typo, not an optional column."""
    for role in sorted(spec.mapped):
        key = spec.columns[role]
        if key is not None and not any(key in r for r in records):
            raise ValueError(
                f"{spec.where()}: column {key!r} (the {role}, named in {INFO_FILE}) is in no record; "
                f"the first record has {', '.join(map(repr, records[0]))}"
            )


def _document(text: str, tokenizer: Tokenizer, end: int) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text) + [end]


# ---------------------------------------------------------------- batches


class TokenBatches:
    """An endless, seeded stream of global batches over `examples`, resumable from `state_dict()`.

    Each epoch visits the examples in a fresh order drawn from
    `random.Random` seeded by (seed, epoch) and yields `len(self)` full
    batches; the few examples that do not fill a last batch wait for a
    later epoch's order (every batch has exactly `batch_size` rows, so a dp
    split is always even). The stream yields the *global* batch on every
    rank and the model's strategy slices each rank's part, so all ranks must
    build it with the same examples and seed: they then draw identical
    batches with no communication. `epoch` counts finished epochs (it turns
    over right after an epoch's last batch), so a loop can stop on it; the
    position (epoch, index of the next batch in that epoch) is
    `state_dict()`, and `load_state_dict` of it continues exactly there.

    A batch is a `hp.train.batch.Batch`: with `vision` (the examples'), a
    vision-language model's, with their images.

    >>> data = [{"input_ids": [i], "labels": [i]} for i in range(5)]
    >>> batches = TokenBatches(data, batch_size=2, seed=0, pad_id=0)
    >>> len(batches), next(batches).input_ids.shape, batches.state_dict()["index"]
    (2, torch.Size([2, 1]), 1)
    """

    def __init__(
        self,
        examples: Sequence[Mapping[str, list]],
        batch_size: int,
        seed: int,
        pad_id: int,
        *,
        pad_to_multiple_of: int = 1,
        vision: Vision | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples cannot fill one batch of {batch_size}; lower the batch size")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.vision = vision
        self.epoch = 0
        self.index = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation), cached

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.examples) // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.epoch, self.index)
        self.advance()
        return batch

    def batch_at(self, epoch: int, index: int) -> Batch:
        """The `index`-th batch of `epoch`, without moving the stream (a loader's workers collate ahead with it)."""
        order = self._permutation(epoch)
        start = index * self.batch_size
        rows = [self.examples[i] for i in order[start : start + self.batch_size]]
        return collate(rows, self.pad_id, self.pad_to_multiple_of, self.vision)

    def advance(self) -> None:
        """Move to the next batch's position."""
        self.index += 1
        if self.index == len(self):
            self.epoch, self.index = self.epoch + 1, 0

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.examples)))
            # A string seed is hashed (sha512) by random.Random: stable across
            # runs, machines and Python versions, and distinct per (seed, epoch).
            random.Random(f"hp.train.data:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def state_dict(self) -> dict[str, int]:
        """The position, plus what must match for it to mean the same batches on resume."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "batch_size": self.batch_size, "num_examples": len(self.examples)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict()`; refuses one taken over other data, seed or batch size."""
        mine = self.state_dict()
        changed = [f"{k} {state[k]} -> {mine[k]}" for k in ("seed", "batch_size", "num_examples")
                   if k in state and state[k] != mine[k]]
        if changed:
            raise ValueError(f"cannot resume the batch stream: {', '.join(changed)} since it was saved")
        if not 0 <= state["index"] < len(self):
            raise ValueError(f"cannot resume the batch stream: index {state['index']} outside 0..{len(self) - 1}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

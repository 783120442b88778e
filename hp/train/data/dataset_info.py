"""Where a config's datasets are and how their records are laid out: LlamaFactory's `dataset_info.json`.

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
LlamaFactory's default `media_dir`), and a `"ranking": true` entry names
its `chosen` and `rejected` columns (none by default, as in LlamaFactory).

Without a `dataset_info.json`, a name may instead be a `.json` or `.jsonl`
file path relative to `dataset_dir`, read as alpaca with default columns.
Only local `.json` (a list of objects) and `.jsonl` (one object a line) files
are read: nothing is downloaded, so hub-only entries are refused. Datasets
are concatenated in the order named; `tools` is read and ignored. An entry
or file that does not read (an unknown name, a missing file, bad JSON, a
column named in `dataset_info.json` that no record has) is a ValueError
naming the dataset and file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def check_mapped_columns(spec: DatasetSpec, records: list[dict[str, Any]]) -> None:
    """A column that dataset_info.json names but no record has is a typo, not an optional column."""
    for role in sorted(spec.mapped):
        key = spec.columns[role]
        if key is not None and not any(key in r for r in records):
            raise ValueError(
                f"{spec.where()}: column {key!r} (the {role}, named in {INFO_FILE}) is in no record; "
                f"the first record has {', '.join(map(repr, records[0]))}"
            )

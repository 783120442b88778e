"""A config as a file: read from YAML (overrides applied, then validated), and written back as plain values.

Why this module exists: the config file is what a user writes and what a
run leaves in its output_dir, so reading it must refuse what PyYAML lets
pass (a key given twice, where PyYAML keeps the last) and name the file in
every error, and writing it must give back a file that validates to the
same config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hp.parallel.strategy import Strategy
from hp.train.config.overrides import apply_overrides
from hp.train.config.schema import Cluster, ConfigError, TrainConfig
from hp.train.config.validation import validate


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last)."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise ConfigError(f"key {key!r} is given twice (line {seen[key] + 1} and line {key_node.start_mark.line + 1}): "
                              "expected each key once")
        if isinstance(key, (str, int, float, bool)):
            seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read the YAML file at `path`, apply `overrides` (``key=value``, ``parallel.tp=2``), and validate.

    Values of overrides are read as YAML, so ``bf16=true`` is a bool and
    ``parallel.tp=2`` an int; a value that is not YAML stays a string.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp, "sft.yaml")
    ...     _ = path.write_text("model_name_or_path: hp/tiny-llama\\ndataset: alpaca_en_demo\\noutput_dir: out\\n")
    ...     cfg = load_config(path, ["bf16=true", "parallel.tp=2"])
    >>> cfg.bf16, cfg.parallel.tp, cfg.nproc_per_node
    (True, 2, 2)
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist: expected the path of a YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"config file {str(path)!r} holds a {type(raw).__name__}: expected a mapping of keys to values")
    return validate(apply_overrides(raw or {}, overrides, base_dir=path.parent), base_dir=path.parent)


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain dicts, lists, strings, numbers and bools, for YAML or JSON in output_dir.

    `validate(to_dict(config))` gives `config` back.

    >>> cfg = validate({"model_name_or_path": "m", "dataset": "a, b", "output_dir": "o"})
    >>> d = to_dict(cfg)
    >>> d["dataset"], d["parallel"]["dp"], d["nproc_per_node"]
    ('a,b', 1, 1)
    >>> validate(d) == cfg
    True
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "no_effect":
            out.update(value)
            continue
        if f.name == "notes":
            continue
        if f.name == "parallel_auto":  # written as the YAML writes it: parallel: auto
            if value:
                out["parallel"] = "auto"
            continue
        if isinstance(value, Strategy):
            value = value.as_dict()
            place = value.pop("mpmd_place")  # written as the YAML writes it: mpmd: {place: {...}}
            zero_bubble = value.pop("mpmd_zero_bubble")
            if place is not None:
                value["mpmd"] = {"place": place} | ({"zero_bubble": True} if zero_bubble else {})
        elif isinstance(value, Cluster):
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out

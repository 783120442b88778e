"""Command-line overrides of a config file: `hp train CONFIG.yaml key=value section.key=value ...`.

Why this module exists: a run is often the file with one or two values
changed, and editing a copy of the file for each is how configs drift. An
override's value is read as YAML (``bf16=true`` is a bool, ``parallel.tp=2``
an int; a value that is not YAML stays a string); only the override syntax
is checked here, the values are checked with the rest of the config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from hp.train.config.hyper_parallel import read_hyper_parallel_args
from hp.train.config.schema import ConfigError

SECTIONS = ("parallel", "hyper_parallel_args", "cluster")  # the mappings a dotted key reaches into


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str],
                    *, base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """A copy of `raw` with each ``key=value`` (or ``section.key=value``) of `overrides` set.

    A dotted key reaches into the `parallel`, `hyper_parallel_args` or `cluster` section
    (a hyper_parallel_args JSON path is read first, so its keys can be
    overridden). Nothing is validated here but the override syntax.

    >>> apply_overrides({"bf16": False}, ["bf16=true", "parallel.tp=2", "learning_rate=1e-4"])
    {'bf16': True, 'parallel': {'tp': 2}, 'learning_rate': '1e-4'}
    """
    out = dict(raw)
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected KEY=VALUE, such as bf16=true or parallel.tp=2")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        section, dot, name = key.partition(".")
        if not dot:
            out[key] = value
            continue
        if section not in SECTIONS or not name or "." in name:
            raise ConfigError(f"override {override!r}: a dotted key is SECTION.KEY with SECTION one of "
                              f"{', '.join(SECTIONS)}, such as parallel.tp=2")
        current = out.get(section)
        if section == "hyper_parallel_args" and isinstance(current, (str, os.PathLike)):
            current = read_hyper_parallel_args(current, base_dir)
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            raise ConfigError(f"override {override!r}: {section} = {current!r} is not a mapping to set {name!r} in")
        out[section] = {**current, name: value}
    return out

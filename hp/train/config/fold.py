"""The strategy fields a config sets, gathered from every key that sets one.

Why this module exists: a degree may be written in the `parallel:`
section, in LlamaFactory's `hyper_parallel_args`, in a DeepSpeed file or in
HF Trainer's `fsdp` keys. A `Fold` takes them all, remembers the key that
set each field first, and so can name both keys when two disagree, and the
key as written when `hp.Strategy` refuses a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp.parallel.strategy import DEFAULTS, Strategy, StrategyError

from hp.train.config.schema import ConfigError


class Fold:
    """Strategy fields gathered from several keys, each remembered with the key that set it first.

    >>> fold = Fold()
    >>> fold.add("parallel.tp = 2", {"tp": 2})
    >>> fold.add("deepspeed (ds.json): AutoTP", {"tp": 4})
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: parallel.tp = 2 conflicts with deepspeed (ds.json): AutoTP (which sets tp = 4): expected the same value, or the degree set in one place
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.source: dict[str, str] = {}  # field -> "key = value" that set it

    def get(self, name: str) -> Any:
        """The field's value so far, else the strategy's default."""
        return self.values.get(name, DEFAULTS[name])

    def add(self, label: str, fields: Mapping[str, Any]) -> None:
        """Set `fields` as the key `label` asks; a field already set otherwise is a conflict."""
        for name, wanted in fields.items():
            if name in self.values and self.values[name] != wanted:
                raise ConfigError(f"{self.source[name]} conflicts with {label} (which sets {name} = {wanted!r}): "
                                  "expected the same value, or the degree set in one place")
            self.values[name] = wanted
            self.source.setdefault(name, label)

    def strategy(self) -> Strategy:
        """The `hp.Strategy` of the fields; its refusal names the key that set the field."""
        try:
            return Strategy(**self.values)
        except StrategyError as e:
            label = self.source.get(e.key, f"parallel.{e.key} = {e.value!r}")
            raise ConfigError(f"{label}{e.problem}") from None


def launched_ranks(values: Mapping[str, Any]) -> int | None:
    """Every launched rank, when nproc_per_node says it.

    >>> launched_ranks({"nproc_per_node": 4, "nnodes": 2}), launched_ranks({})
    (8, None)
    """
    nproc = values.get("nproc_per_node")
    return None if nproc is None else nproc * values.get("nnodes", 1)

"""What trains, as values: LoRA's settings, LlamaFactory's freeze tuning, or every weight.

Torch-free, so that a configuration holds and checks them before any worker
starts; `hp.parallel.lora` and `hp.train.finetuning` apply them to a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class LoraError(ValueError):
    """A LoRA setting that cannot be applied, named with the value at fault."""


@dataclass(frozen=True)
class Lora:
    """Which linears get adapters, and their shape.

    `targets`: module names (a full dotted name, or its last part, as PEFT's `target_modules`),
    or `("all",)` for every linear of the decoder blocks. `alpha` defaults to twice the rank
    (LlamaFactory's default). `extra` names modules trained in full beside the adapters
    (LlamaFactory's `additional_target`, PEFT's `modules_to_save`).

    >>> Lora(rank=8).scale, Lora(rank=16, alpha=16, rslora=True).scale
    (2.0, 4.0)
    """

    rank: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all",)
    rslora: bool = False
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "extra", tuple(self.extra))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"lora rank = {self.rank!r}: expected a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"lora dropout = {self.dropout!r}: expected a probability in [0, 1)")
        if self.alpha is not None and self.alpha <= 0:
            raise LoraError(f"lora alpha = {self.alpha!r}: expected a positive number")
        if not self.targets:
            raise LoraError("lora targets = (): name the linears to adapt, or 'all'")

    @property
    def scale(self) -> float:
        """The factor of B A x: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        alpha = 2.0 * self.rank if self.alpha is None else float(self.alpha)
        return alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class FreezeError(ValueError):
    """A freeze setting that names nothing in the model."""


@dataclass(frozen=True)
class Freeze:
    """LlamaFactory's freeze tuning: which blocks, and which of their modules, train.

    >>> Freeze(trainable_layers=-1, trainable_modules=("mlp",)).trainable_modules
    ('mlp',)
    """

    trainable_layers: int = 2
    trainable_modules: tuple[str, ...] = ("all",)
    extra_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finetuning:
    """What trains: everything (neither set), adapters, or part of the blocks."""

    lora: Lora | None = None
    freeze: Freeze | None = None

"""`hp plan --search`: every strategy a world can run a model with, traced and timed, fastest first.

Why: the question a user asks before renting a cluster is not "does my
strategy fit" but "how should I split it". hp answers it the way it answers
the first question: each candidate is laid out and its step traced by the
code a run uses (`hp.plan.step.fake_step`, then `hp.plan.memory.memory_of`
counting `hp.plan.step_time.work_of`'s work in the same run), then priced on the
device's profile. Nothing is ranked by a formula.

The candidates split the world into data parallel (plain, or FSDP over the
data and context axes), tensor parallel (always with sequence parallel: the
same bytes as tp's all-reduces, a tp-th of the activations between blocks)
and context parallel (ring and Ulysses), each with recompute on and off. All
of them take the same global batch (the config's rows per device times the
world, split over each candidate's dp) so that their times compare as tokens
per second do. A candidate whose shapes do not divide, or whose step does not
fit the device, is kept with the reason; the fastest that fits comes first.
Pipeline stages, expert parallel and tp2d are not searched yet: their steps
are not traced by `hp plan` (pipeline, experts) or their layouts need a
mesh of their own choosing (`parallel.tp2d: auto` already picks one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hp.parallel.strategy import Strategy
from hp.plan.devices import GIB, DeviceProfile
from hp.plan.memory import StepMemory, memory_of
from hp.plan.step import StepShape, fake_step
from hp.plan.step_time import StepTime, WorkCount, predict
from hp.train.finetuning import Finetuning


@dataclass(frozen=True)
class Candidate:
    """One strategy of the search: its traced peak and predicted step on the device, or why it cannot run."""

    strategy: dict[str, Any]
    memory: StepMemory | None = None
    time: StepTime | None = None
    refused: str | None = None  # the shapes do not divide, or the step does not fit the device
    tokens: int = 0  # the global batch's tokens, for tokens per second

    @property
    def runs(self) -> bool:
        return self.refused is None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.time.total if self.time is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "peak_bytes": self.memory.peak if self.memory else None,
                "step_s": self.time.total if self.time else None, "tokens_per_s": self.tokens_per_s,
                "refused": self.refused}


def strategies(world: int) -> list[dict[str, Any]]:
    """Every dp x tp x cp split of `world` ranks with its switches, in a fixed order.

    >>> [s for s in strategies(2) if not s.get("recompute")]  # doctest: +NORMALIZE_WHITESPACE
    [{'dp': 2}, {'dp': 2, 'fsdp': True},
     {'cp': 2, 'cp_algorithm': 'ring'}, {'cp': 2, 'cp_algorithm': 'ring', 'fsdp': True},
     {'cp': 2, 'cp_algorithm': 'ulysses'}, {'cp': 2, 'cp_algorithm': 'ulysses', 'fsdp': True},
     {'tp': 2, 'sp': True}]
    """
    found = []
    for tp in _divisors(world):
        for cp in _divisors(world // tp):
            dp = world // (tp * cp)
            axes = {name: size for name, size in (("dp", dp), ("cp", cp), ("tp", tp)) if size > 1}
            for algorithm in (("ring", "ulysses") if cp > 1 else (None,)):
                for fsdp in ((False, True) if dp * cp > 1 else (False,)):
                    for recompute in (False, True):
                        found.append({**axes, **({"cp_algorithm": algorithm} if algorithm else {}),
                                      **({"sp": True} if tp > 1 else {}), **({"fsdp": True} if fsdp else {}),
                                      **({"recompute": True} if recompute else {})})
    return found


def search(hf_config, world: int, rows_per_device: int, tokens: int, device: DeviceProfile, *, bf16: bool = False,
           finetuning: Finetuning | None = None, check=None, among: list[dict[str, Any]] | None = None
           ) -> list[Candidate]:
    """Each of `strategies(world)` (or of `among`) for `hf_config`'s model, a global batch of `rows_per_device *
    world` rows of `tokens` tokens: traced, priced on `device`, fastest first (those that cannot run last, with the
    reason). `check(strategy)`, when given, refuses a strategy as `hp train` would (a ValueError names why). About a
    second a candidate for a tiny model here.

    >>> from hp.models import tiny_config
    >>> from hp.plan.devices import PROFILES
    >>> ranked = search(tiny_config("llama", layers=1), 3, 2, 32, PROFILES["h100-80g"],
    ...                 among=[{"tp": 3, "sp": True}, {"cp": 3, "cp_algorithm": "ulysses"}, {"dp": 3}])
    >>> [c.strategy for c in ranked if c.runs], ranked[0].tokens_per_s > 0
    ([{'dp': 3}], True)
    >>> [c.refused.splitlines()[0] for c in ranked[1:]]  # doctest: +NORMALIZE_WHITESPACE
    ["parameter 'model.layers.0.self_attn.q_proj.weight' of shape (64, 64): dimension 0 has size 64, not divisible
    by its 3 shards (tp=3); pass uneven=True to allow torch.chunk-style uneven shards",
    'cp = 3 does not divide the 32 tokens of a row']
    """
    shape = StepShape(rows=rows_per_device * world, tokens=tokens, bf16=bf16)
    found = [_traced(hf_config, strategy, shape, device, finetuning, check) for strategy in among or strategies(world)]
    return sorted(found, key=lambda c: (not c.runs, c.time.total if c.time else 0.0, c.memory.peak if c.memory else 0))


def search_config(config, hf_config, world: int, device: DeviceProfile, among: list[dict[str, Any]] | None = None
                  ) -> list[Candidate]:
    """`search` for an `hp train` config (`hp.train.config.TrainConfig`) on `world` ranks of `device` (among
    `among`, else every split): its model, rows per device, tokens, bf16 and finetuning, each candidate refused as
    `hp train` would refuse it. What `hp plan` cannot trace yet is refused by name (a ValueError:
    `hp.plan.step.config_step`).

    >>> from hp.train.config import validate
    >>> from hp.models import tiny_config
    >>> from hp.plan.devices import PROFILES
    >>> config = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o", "cutoff_len": 16})
    >>> [c.strategy for c in search_config(config, tiny_config("llama", layers=1), 1, PROFILES["h100-80g"])]
    [{}, {'recompute': True}]
    """
    from hp.plan.step import config_step
    from hp.train.config import strategy_labels
    from hp.train.model import check_fits

    _, shape, finetuning = config_step(config, hf_config)

    def check(strategy) -> None:  # hp train's refusal of shapes a strategy cannot split, with its message
        check_fits(hf_config, strategy, name=config.model_name_or_path, labels=strategy_labels(config),
                   finetuning=config.finetuning)

    return search(hf_config, world, config.per_device_train_batch_size, shape.tokens, device, bf16=shape.bf16,
                  finetuning=finetuning, check=check, among=among)


def _traced(hf_config, strategy: dict[str, Any], shape: StepShape, device: DeviceProfile,
            finetuning: Finetuning | None, check) -> Candidate:
    """One candidate: refused by `check` or by its shapes, traced, and priced unless its peak exceeds the device."""
    tokens, parsed = shape.rows * shape.tokens, Strategy.of(strategy)
    try:
        if check is not None:
            check(parsed)
        if shape.tokens % parsed.cp:  # a row the trace could not split evenly
            raise ValueError(f"cp = {strategy['cp']} does not divide the {shape.tokens} tokens of a row")
        with fake_step(hf_config, strategy, shape, finetuning) as step:  # laid out and run once for both
            counted = WorkCount(step)
            memory = memory_of(step, device.backend, inside=counted)
            work = counted.work if memory.peak <= device.memory_bytes else None
    except ValueError as refused:
        return Candidate(strategy, refused=str(refused), tokens=tokens)
    if work is None:
        return Candidate(strategy, memory, refused=f"peaks at {memory.peak / GIB:.2f} GiB, over {device.name}'s "
                         f"{device.memory_bytes / GIB:.2f} GiB", tokens=tokens)
    return Candidate(strategy, memory, predict(work, device), tokens=tokens)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

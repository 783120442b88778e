"""`hp plan --dry-run`: a strategy laid out at its full world size in one process, and what rank 0 holds.

Why: whether a strategy is legal at 4096 ranks (every split divides, every
axis exists, the plan fits the model) and how many parameters one rank
holds are questions about layouts, not about arithmetic on accelerators. hp
answers them with the code a training run uses: the model is built on the
meta device, the world is a fake process group of the strategy's size
(`hp.strategy_mesh(..., simulate=True)`), and `hp.apply_strategy` places
every parameter. Rank 0's shards are then read off the laid-out model.

Model states per rank follow from them, as a training step keeps them:
parameters and gradients in fp32 (hp trains fp32 master weights; bf16 is
a compute dtype), and AdamW's two fp32 moments, for the parameters that
train. A dim split over ranks that does not divide is reported by name
(FSDP pads it, so rank 0 holds the larger piece; tensor parallel refuses it
before this point).

Not yet here: the pipeline axis (stages are cut by `hp train`'s pipelined
runner, not by `apply_strategy`), activations, and ranks other than 0.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.models import plan_for
from hp.parallel.apply import apply_strategy, strategy_mesh
from hp.parallel.strategy import Strategy
from hp.plan.shapes import reference_config
from hp.train.config import TrainConfig, strategy_labels
from hp.train.finetuning import Finetuning, apply_finetuning
from hp.train.model import check_fits, model_class

FP32 = 4
ADAM_STATES = 2  # AdamW's first and second moments, fp32 each


@dataclass(frozen=True)
class DryRun:
    """What rank 0 of a world laid out by a strategy holds, and how long laying it out took."""

    world: int
    strategy: str
    parameters: int  # the whole model's
    rank_parameters: int  # rank 0's share
    rank_trainable: int
    uneven: tuple[str, ...]  # "name: dim d of n over k ranks (m tensors)", for splits that do not divide
    seconds: float

    @property
    def state_bytes(self) -> dict[str, int]:
        """Rank 0's model states in bytes: parameters, gradients and optimizer states."""
        return {"parameters": FP32 * self.rank_parameters, "gradients": FP32 * self.rank_trainable,
                "optimizer_states": ADAM_STATES * FP32 * self.rank_trainable}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state_bytes": self.state_bytes, "uneven": list(self.uneven),
                "seconds": round(self.seconds, 3)}


def dry_run(hf_config, strategy: Strategy | Mapping[str, Any], finetuning: Finetuning | None = None) -> DryRun:
    """Lay `hf_config`'s model out under `strategy` on a fake world of its size; rank 0's holdings.

    >>> from hp.plan import reference_config
    >>> run = dry_run(reference_config("llama-3.1-8b"), {"dp": 16, "tp": 8, "fsdp": True})
    >>> run.world, run.parameters, run.rank_parameters
    (128, 8030261248, 91480320)
    """
    strategy = Strategy.of(strategy)
    if strategy.pp > 1:
        raise ValueError(f"pp = {strategy.pp}: hp plan --dry-run does not cut pipeline stages yet (hp train's "
                         "pipelined runner cuts them, not apply_strategy); plan with pp = 1")
    start = time.perf_counter()
    mesh = strategy_mesh(strategy, simulate=True)
    with torch.device("meta"):
        model = model_class(hf_config).from_config(hf_config)
    plan = plan_for(hf_config)
    if finetuning is not None:
        apply_finetuning(model, finetuning, plan.blocks)
    whole = sum(p.numel() for p in model.parameters())
    apply_strategy(model, mesh, strategy, plan)
    held = trainable = 0
    uneven: Counter = Counter()
    for name, p in model.named_parameters():
        local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        held += local
        trainable += local if p.requires_grad else 0
        uneven.update(_uneven(re.sub(r"\.\d+\.", ".*.", name), p))  # one line for a layer's tensor in every layer
    notes = tuple(f"{split} ({n} tensors)" if n > 1 else split for split, n in uneven.items())
    return DryRun(strategy.world_size, describe(strategy), whole, held, trainable, notes, time.perf_counter() - start)


def dry_run_config(config: TrainConfig, devices: int | None = None, hf_config=None) -> DryRun:
    """`dry_run` of an `hp train` config's model and strategy; `devices`, when given, must be its world size;
    `hf_config`, when given, the model's config as `hf_config_of` reads it.

    >>> from hp.train.config import validate
    >>> config = validate({"model_name_or_path": "llama-3.1-8b", "dataset": "d", "output_dir": "o",
    ...                    "parallel": {"dp": 16, "tp": 8, "fsdp": True}})
    >>> dry_run_config(config, devices=128).rank_parameters
    91480320
    >>> dry_run_config(config, devices=256)
    Traceback (most recent call last):
    ...
    ValueError: --devices 256: the config's parallel section (dp=16 tp=8 fsdp recompute) runs on 128 ranks; \
set its degrees to multiply to 256, or rank every split of 256 ranks with --search
    """
    strategy = config.parallel
    if devices is not None and devices != strategy.world_size:
        raise ValueError(f"--devices {devices}: the config's parallel section ({describe(strategy)}) runs on "
                         f"{strategy.world_size} ranks; set its degrees to multiply to {devices}, "
                         f"or rank every split of {devices} ranks with --search")
    hf_config = hf_config or hf_config_of(config.model_name_or_path)
    # the check hp train's launcher makes, with its message: shapes the strategy cannot split, axes the model lacks
    check_fits(hf_config, strategy, name=config.model_name_or_path, labels=strategy_labels(config),
               finetuning=config.finetuning)
    return dry_run(hf_config, strategy, config.finetuning)


def hf_config_of(name_or_path: str):
    """The HF config `hp plan` lays out: an embedded model's, a local directory's (first, as hp train reads it), or
    a reference shape's."""
    from hp.train.data import load_tokenizer
    from hp.train.data.embedded import EMBEDDED, model_config

    if name_or_path in EMBEDDED or os.path.isfile(os.path.join(name_or_path, "config.json")):
        return model_config(name_or_path, load_tokenizer(name_or_path).vocab_size)
    return reference_config(name_or_path)  # a reference shape, or the error that names them


def _uneven(name: str, p: torch.Tensor) -> list[str]:
    """The dims of `p` whose split over the mesh does not divide evenly."""
    if not isinstance(p, DTensor):
        return []
    ways: dict[int, int] = {}
    for axis, placement in enumerate(p.placements):
        if isinstance(placement, (Shard, _StridedShard)):  # FSDP over tp's shards: strided
            ways[placement.dim] = ways.get(placement.dim, 1) * p.device_mesh.size(axis)
    return [f"{name}: dim {d} of {p.shape[d]} over {k} ranks" for d, k in sorted(ways.items()) if p.shape[d] % k]


def describe(strategy: Strategy | Mapping[str, Any]) -> str:
    """The strategy's axes and switches, as a user writes them: 'dp=512 tp=8 fsdp', 'cp=2 ring'.

    >>> describe({"cp": 2, "cp_algorithm": "ring", "recompute": True}), describe({})
    ('cp=2 ring recompute', 'one rank')
    """
    strategy = Strategy.of(strategy)
    axes = " ".join(f"{axis}={size}" for axis, size in strategy.mesh_axes.items() if size > 1)
    switches = [name for name in ("fsdp", "sp", "recompute") if getattr(strategy, name, False)]
    algorithm = [strategy.cp_algorithm] if strategy.cp > 1 else []
    return " ".join([axes or "one rank", *algorithm, *switches])

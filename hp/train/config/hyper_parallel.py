"""LlamaFactory's HyperParallel keys: `use_hyper_parallel` with `hyper_parallel_args`, read as strategy fields.

Why this module exists: LlamaFactory switches its HyperParallel backend on
with `use_hyper_parallel: true` and takes the layout from
`hyper_parallel_args`, a dict or a JSON file of tp_size, cp_size, ep_size,
fsdp_size, activation_mode, and for expert parallel efsdp_size,
token_dispatcher, ep_style and expert_module_cls. hp does the same things
with its own strategy, so each key is checked here and honoured where hp
does the same thing (the degrees set strategy fields, fsdp_size sets dp and
FSDP, efsdp_size must be the ranks hp's FSDP shards each expert over), and
refused by name where it does not. `hyper_parallel_cp_size`, LlamaFactory's
top-level override of cp_size, is applied too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from hp.parallel.strategy import DTYPES, Strategy

from hp.train.config.fold import Fold, launched_ranks
from hp.train.config.rules import HYPER_TO_PARALLEL, Rule, check_value, nonempty, refuse, unknown_key
from hp.train.config.schema import ACTIVATION_MODES, ConfigError, TrainConfig
from hp.train.config.sharding_keys import ShardingKeyError, read_json

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # HyperParallel's short spellings
# LlamaFactory's HyperParallel keys (the degrees among them set the parallel key HYPER_TO_PARALLEL names).
HYPER_RULES: dict[str, Rule] = {
    "tp_size": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp_size": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "ep_size": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "fsdp_size": Rule("int", lambda v: v >= 1, "an integer >= 1 (the ranks FSDP shards over: dp * cp)"),
    "activation_mode": Rule("str", choices=ACTIVATION_MODES),
    # HyperParallel's swap also moves each block's inputs unless this is false; hp.offload's planner decides per
    # saved tensor, block inputs among them, so the key is taken and changes nothing
    "activation_swap_inputs": Rule("bool"),
    "reshard_after_forward": Rule("bool"),
    "param_dtype": Rule("str", choices=DTYPES + tuple(DTYPE_ALIASES)),
    "reduce_dtype": Rule("str", choices=DTYPES + tuple(DTYPE_ALIASES)),
    # HyperParallel's expert parallel: honoured where hp does the same thing, refused otherwise
    "efsdp_size": Rule("int", lambda v: v >= 1, "an integer >= 1 (the ranks FSDP shards each expert over: "
                       "dp / ep * cp), or null", optional=True),
    "token_dispatcher": Rule("str", choices=("all_to_all",), allowed=(
        "(hp sends each token to its experts' ranks with one all-to-all of uneven splits over ep, HyperParallel's "
        "'all_to_all'; the two-stage 'deredundency' dispatch is not available)")),
    "ep_style": Rule("str", choices=("ep",), allowed=(
        "(hp splits whole experts over ep and keeps each expert whole over tp, whose ranks hold the same tokens: "
        "HyperParallel's 'ep'; experts split over tp are not available)")),
    "expert_module_cls": Rule("str", nonempty, "the class name of the model's MoE block or experts module "
                              "(checked against the model before any worker starts)"),
}
# hyper_parallel_args keys that set no strategy field by themselves: checked once the strategy is known
# (fsdp_size: dp and fsdp; efsdp_size: against the strategy; expert_module_cls: against the model, in preflight)
HYPER_CHECKED = ("fsdp_size", "efsdp_size", "token_dispatcher", "ep_style", "expert_module_cls",
                 "activation_swap_inputs")
# HyperParallel keys hp knows but cannot honour yet, and why.
HYPER_NOT_YET = {
    "plan_overrides": "hp's model plans are data of each family in hp.models; a run does not override them",
}


def checked_hyper_args(raw: Mapping[str, Any], enabled: bool,
                       base_dir: str | os.PathLike | None) -> dict[str, Any] | None:
    """LlamaFactory's hyper_parallel_args as a checked dict (read from JSON when a path), or None."""
    args = raw.get("hyper_parallel_args")
    if not enabled:
        for key, harmless in (("hyper_parallel_args", None), ("hyper_parallel_cp_size", 1)):  # 1: LlamaFactory's default
            if raw.get(key) not in (None, harmless):
                raise ConfigError(f"{key} = {raw[key]!r} is given but use_hyper_parallel is not true: "
                                  f"expected use_hyper_parallel: true alongside it, or no {key}")
        return None
    if args is None:
        args = {}
    elif isinstance(args, (str, os.PathLike)):
        args = read_hyper_parallel_args(args, base_dir)
    elif not isinstance(args, Mapping):
        raise refuse("hyper_parallel_args", args, "a mapping of tp_size, cp_size, ep_size, fsdp_size, activation_mode, "
                     "or the path of a JSON file holding one")
    for key, value in args.items():
        if key in HYPER_NOT_YET:
            raise ConfigError(f"hyper_parallel_args.{key} = {value!r} is not taken by hp train yet "
                              f"({HYPER_NOT_YET[key]}); expected no {key} key")
        if key not in HYPER_RULES:
            raise unknown_key(key, value, tuple(HYPER_RULES), "hyper_parallel_args.")
    checked = {key: check_value(f"hyper_parallel_args.{key}", args[key], rule)
               for key, rule in HYPER_RULES.items() if key in args}
    return {key: DTYPE_ALIASES.get(value, value) if key.endswith("_dtype") else value for key, value in checked.items()}


def read_hyper_parallel_args(path: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The JSON object in `path` (relative: from the current directory, else from `base_dir`).

    >>> read_hyper_parallel_args("no/such.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: hyper_parallel_args = 'no/such.json': expected the path of a JSON file, ...
    """
    try:
        return read_json("hyper_parallel_args", path, base_dir)[0]
    except ShardingKeyError as e:
        raise ConfigError(str(e)) from None


def strategy_labels(config: TrainConfig) -> dict[str, str]:
    """The key each strategy field was written as, where it is not `parallel.FIELD` (for later messages).

    >>> from hp.train.config import validate
    >>> strategy_labels(validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "o",
    ...                           "use_hyper_parallel": True, "hyper_parallel_args": {"tp_size": 2}}))
    {'tp': 'hyper_parallel_args.tp_size'}
    """
    hyper = config.hyper_parallel_args or {}
    return {name: f"hyper_parallel_args.{key}" for key, name in HYPER_TO_PARALLEL.items() if key in hyper}


def override_cp_size(hyper: dict[str, Any], cp_size: int | None) -> tuple[dict[str, Any], str]:
    """LlamaFactory's top-level hyper_parallel_cp_size replaces hyper_parallel_args' cp_size."""
    if cp_size is None:
        return hyper, ""
    note = ""
    if hyper.get("cp_size", cp_size) != cp_size:
        note = (f"hyper_parallel_cp_size = {cp_size} replaces hyper_parallel_args.cp_size = {hyper['cp_size']} "
                "(as LlamaFactory does)")
    return {**hyper, "cp_size": cp_size}, note


def fold_fsdp_size(fold: Fold, size: int, values: Mapping[str, Any]) -> None:
    """HyperParallel's fsdp_size > 1: FSDP over that many dp * cp ranks, which must be all that tp leaves."""
    cp, tp = fold.get("cp"), fold.get("tp")
    label = f"hyper_parallel_args.fsdp_size = {size}"
    if size % cp:
        raise ConfigError(f"{label}: expected a multiple of cp = {cp} (FSDP shards over the dp * cp ranks)")
    fold.add(label, {"dp": size // cp, "fsdp": True})
    world = launched_ranks(values)
    if world is not None and size * tp != world:
        raise ConfigError(f"{label} with {world} ranks and tp = {tp}: FSDP over part of the ranks with replicas "
                          f"across the rest (HSDP) is not available yet; expected fsdp_size = {world // tp} "
                          "(the ranks tp leaves), or no fsdp_size")


def check_efsdp_size(strategy: Strategy, size: int, fsdp_size: int | None) -> None:
    """HyperParallel's efsdp_size: the ranks FSDP shards each expert over, which hp fixes (dp / ep * cp with FSDP)."""
    ranks = math.prod(strategy.mesh_axes[axis] for axis in strategy.expert_fsdp_axes)
    if size == ranks:
        return
    label = f"hyper_parallel_args.efsdp_size = {size}"
    if not strategy.fsdp:
        why = ("fsdp_size = 1 turns FSDP off" if fsdp_size == 1 else
               f"FSDP has no ranks to shard over (dp * cp = {strategy.dp * strategy.cp})")
        raise ConfigError(f"{label}: {why}, so hp keeps each rank's experts whole; expected efsdp_size = 1, or no "
                          "efsdp_size")
    over = f"dp / ep * cp = {strategy.dp} / {strategy.ep} * {strategy.cp} = {ranks}"
    raise ConfigError(f"{label}: hp's FSDP shards each expert over the ranks that hold the same experts, {over}; "
                      "fewer, with replicas of the experts across the rest (HSDP), is not available yet; expected "
                      f"efsdp_size = {ranks}, or no efsdp_size")


def fsdp_everywhere(fold: Fold) -> list[str]:
    """HyperParallel's fsdp_size unset: FSDP over every dp * cp rank (LlamaFactory's default), when there are some."""
    ranks = fold.get("dp") * fold.get("cp")
    if ranks == 1:
        return []
    fold.add("use_hyper_parallel = True (fsdp_size unset: FSDP over every rank tp leaves; fsdp_size: 1 for none)",
             {"fsdp": True})
    return [f"use_hyper_parallel: FSDP over all {ranks} dp * cp ranks (fsdp_size unset, as in LlamaFactory)"]

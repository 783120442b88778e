"""The `parallel:` section and every other key that shards the model, folded into one `hp.Strategy`.

Why this module exists: a LlamaFactory config may say how to shard in
several places at once: hp's own `parallel:` section (dp, tp, cp, sp, ep,
fsdp, offload, ...), LlamaFactory's HyperParallel keys
(`hp.train.config.hyper_parallel`), a DeepSpeed file or HF Trainer's `fsdp`
keys (`hp.train.config.sharding_keys`), and `torch_compile`. Here they are
read into one strategy (a `Fold`, so that two keys setting one field
differently are named together), dp is derived from the launched ranks when
unset, activation recompute is set as LlamaFactory sets it, and each
translation leaves the note the launcher prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from hp.parallel.strategy import Strategy
from hp.train.config.fold import Fold, launched_ranks
from hp.train.config.hyper_parallel import (
    HYPER_CHECKED,
    check_efsdp_size,
    fold_fsdp_size,
    fsdp_everywhere,
    override_cp_size,
)
from hp.train.config.rules import (
    HYPER_TO_PARALLEL,
    PARALLEL_RULES,
    PLACE_RULE,
    Rule,
    check_keys,
    check_value,
    refuse,
)
from hp.train.config.schema import ConfigError, TrainConfig
from hp.train.config.sharding_keys import (
    ShardingKeyError,
    Translation,
    from_deepspeed,
    from_hf_fsdp,
)

# The strategy fields each activation mode sets. HyperParallel swaps to host memory; here the slow tier is the
# disk, the one hp.offload has on every machine (the host tier for accelerators is not built yet).
_ACTIVATION_FIELDS = {"none": {}, "recompute": {"recompute": True}, "swap": {"offload": "disk"}}
# sharding keys of DeepSpeed and HF Trainer (the last changes nothing: FSDP wraps every decoder block anyway)
ELSEWHERE_KEYS = ("deepspeed", "fsdp", "fsdp_config", "fsdp_transformer_layer_cls_to_wrap")


AUTO = "auto"  # `parallel: auto`: every degree chosen by hp plan's search for the launched ranks (hp.plan.auto)


def check_auto(raw: Mapping[str, Any], hyper: Any, elsewhere: Any) -> None:
    """`parallel: auto` needs the ranks it splits, and no other key that shards the model.

    >>> check_auto({"nproc_per_node": 2}, None, [])
    >>> check_auto({}, None, [])
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: parallel = 'auto' splits the ranks hp train launches: set nproc_per_node (and nnodes over several machines)
    """
    if launched_ranks(raw) is None:
        raise ConfigError(f"parallel = {AUTO!r} splits the ranks hp train launches: set nproc_per_node (and nnodes "
                          "over several machines)")
    if hyper is not None or elsewhere:
        given = "hyper_parallel_args" if hyper is not None else ("deepspeed" if raw.get("deepspeed") else "fsdp")
        raise ConfigError(f"parallel = {AUTO!r} chooses every degree itself: leave {given} out, or write the degrees "
                          "in parallel:")


def parallel_section(section: Any) -> dict[str, Any]:
    """The keys given in the `parallel:` section, checked (absent keys stay absent)."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise refuse("parallel", section, f"a mapping such as {{dp: 2, tp: 2}}, or {AUTO!r}")
    check_keys(section, tuple(PARALLEL_RULES), "parallel.")
    if isinstance(section.get("offload"), Mapping):
        section = {**section, **_offload_mapping(section["offload"], "offload_budget" in section)}
    place = {}
    if isinstance(section.get("mpmd"), Mapping):  # {chunks: N} (level 1), or {place: {vision: pp}} (levels 2-3)
        mpmd = dict(section["mpmd"])
        chunks_alone = "chunks" not in mpmd or len(mpmd) == 1  # level 1 takes no level 2-3 keys beside it
        if not mpmd or set(mpmd) - {"chunks", "place", "zero_bubble"} or not chunks_alone:
            raise refuse("parallel.mpmd", mpmd, PARALLEL_RULES["mpmd"].allowed)
        if "place" in mpmd:
            place = {"mpmd_place": check_value("parallel.mpmd.place", mpmd["place"], PLACE_RULE)}
        if "zero_bubble" in mpmd:
            place["mpmd_zero_bubble"] = check_value("parallel.mpmd.zero_bubble", mpmd["zero_bubble"], Rule("bool"))
        section = {**section, "mpmd": mpmd.get("chunks", "auto") if "chunks" in mpmd else None}
    return {**{key: check_value(f"parallel.{key}", section[key], rule)
               for key, rule in PARALLEL_RULES.items() if key in section}, **place}


def _offload_mapping(value: Mapping, budget_given: bool) -> dict[str, Any]:
    """`parallel.offload: {budget: 0.5, tiers: [device, disk]}` as the offload and offload_budget keys."""
    unknown = set(value) - {"budget", "tiers"}
    if unknown:
        raise refuse("parallel.offload", dict(value), "a tier (disk) or a mapping of budget (a fraction of the "
                     f"step's peak) and tiers ([device, disk]); unknown key {sorted(unknown)[0]!r}")
    tiers = value.get("tiers", ["device", "disk"])
    if not isinstance(tiers, (list, tuple)) or len(tiers) != 2 or tiers[0] != "device":
        raise refuse("parallel.offload.tiers", tiers, "[device, T] with T the slow tier (disk)")
    if budget_given and "budget" in value:
        raise ConfigError("parallel.offload.budget and parallel.offload_budget are both given: expected one of them")
    return {"offload": tiers[1], **({"offload_budget": value["budget"]} if "budget" in value else {})}


def sharding_elsewhere(raw: Mapping[str, Any], base_dir: str | os.PathLike | None) -> list[Translation]:
    """What DeepSpeed's or HF Trainer's sharding keys ask of the strategy (`hp.train.config.sharding_keys`)."""
    if raw.get("deepspeed") is not None and raw.get("fsdp"):
        raise ConfigError(f"deepspeed = {raw['deepspeed']!r} with fsdp = {raw['fsdp']!r}: both pick how the model is "
                          "sharded; expected one of them")
    try:
        if raw.get("deepspeed") is not None:
            return [from_deepspeed(raw["deepspeed"], base_dir)]
        if raw.get("fsdp"):  # HF's default is the empty string: no FSDP
            return [from_hf_fsdp(raw["fsdp"], raw.get("fsdp_config"), base_dir)]
    except ShardingKeyError as e:
        raise ConfigError(str(e)) from None
    if raw.get("fsdp_config") is not None:
        return [Translation("fsdp_config", note="fsdp_config: has no effect without fsdp (as in HF Trainer)")]
    return []


def fold_strategy(given: dict[str, Any], hyper: dict[str, Any] | None, elsewhere: list[Translation],
                  values: Mapping[str, Any]) -> tuple[Strategy, tuple[str, ...]]:
    """The strategy the parallel section, hyper_parallel_args and DeepSpeed/HF fsdp keys ask for, and the notes.

    dp left unset takes the ranks cp and tp leave (nproc_per_node * nnodes / (cp * tp)), as a
    LlamaFactory run is data parallel over every launched rank.
    """
    fold, notes = Fold(), []
    for key, value in given.items():
        fold.add(f"parallel.{key} = {value!r}", _strategy_fields(key, value))
    if hyper is not None:
        hyper, note = override_cp_size(hyper, values.get("hyper_parallel_cp_size"))
        notes += [note] if note else []
        for key, value in hyper.items():
            if key not in HYPER_CHECKED:
                fold.add(f"hyper_parallel_args.{key} = {value!r}", _strategy_fields(key, value))
    for translation in elsewhere:
        fold.add(translation.source, translation.fields)
        notes.append(translation.note)
    if values.get("torch_compile"):
        fold.add("torch_compile = True", {"compile": True})
    if hyper is not None and hyper.get("fsdp_size", 1) > 1:
        fold_fsdp_size(fold, hyper["fsdp_size"], values)
    _derive_dp(fold, values)
    if hyper is not None and "fsdp_size" not in hyper:
        notes += fsdp_everywhere(fold)
    strategy = fold.strategy()
    if hyper is not None and hyper.get("efsdp_size") is not None:
        check_efsdp_size(strategy, hyper["efsdp_size"], hyper.get("fsdp_size"))
    return strategy, tuple(notes)


def _derive_dp(fold: Fold, values: Mapping[str, Any]) -> None:
    """dp, when unset, from the launched ranks that cp and tp leave (none under mpmd.place: its ranks are the
    pipeline's and the placed sub-models')."""
    world = launched_ranks(values)
    if "dp" in fold.values or world is None or fold.get("mpmd_place") is not None:
        return
    tensor = tp2d_ranks(fold.get("tp2d")) or fold.get("tp")
    inner = fold.get("pp") * fold.get("cp") * tensor
    launched = f"nproc_per_node = {values['nproc_per_node']} (x nnodes = {values.get('nnodes', 1)})"
    if world % inner:
        degrees = ("pp * cp * " if fold.get("pp") > 1 else "cp * ") + ("tp2d's x * y * z" if fold.get("tp2d") else "tp")
        raise ConfigError(f"{launched}: {world} ranks do not split into groups of {degrees} = {inner}; expected "
                          f"a multiple of {inner}")
    dp, ep = world // inner, fold.get("ep")
    if dp % ep:
        ep_label = fold.source.get("ep", f"parallel.ep = {ep}")
        raise ConfigError(f"{ep_label} does not divide the data-parallel ranks: {launched} with cp = {fold.get('cp')} "
                          f"and tp = {fold.get('tp')} leaves dp = {world} / (cp * tp) = {dp}, and expert parallel "
                          f"splits the dp ranks into groups of ep; expected an ep that divides {dp}, or "
                          f"nproc_per_node * nnodes a multiple of ep * cp * tp = {ep * inner}")
    if dp > 1:
        fold.add(f"nproc_per_node = {values['nproc_per_node']}", {"dp": dp})


def tp2d_ranks(section: Mapping[str, Any] | None) -> int | None:
    """The ranks of a `tp2d:` section (x * y * z, what it gives of them), None without one.

    >>> tp2d_ranks({"x": 2, "y": 4, "scheme": "auto"}), tp2d_ranks(None)
    (8, None)
    """
    if not section:
        return None
    sizes = [section.get(k, 1) for k in ("x", "y", "z")]
    return math.prod(n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n >= 1)


def with_recompute(strategy: Strategy, given: dict[str, Any], hyper: dict[str, Any] | None,
                   elsewhere: list[Translation], disable: bool) -> Strategy:
    """Activation recompute as LlamaFactory has it: on unless disable_gradient_checkpointing, or as parallel says
    (compiled blocks recompute too, inside each block's graph)."""
    explicit = ("recompute" in given or "offload" in given or "activation_mode" in given
                or "activation_mode" in (hyper or {})
                or any("recompute" in t.fields for t in elsewhere))
    if not explicit:
        return dataclasses.replace(strategy, recompute=not disable)
    if disable and strategy.recompute:
        raise ConfigError("disable_gradient_checkpointing = True conflicts with the parallel settings, which ask for "
                          "recompute (parallel.recompute, activation_mode: recompute or fsdp_config's "
                          "activation_checkpointing): expected one of them")
    return strategy


def _strategy_fields(key: str, value: Any) -> dict[str, Any]:
    """The strategy fields that one parallel or hyper_parallel_args key sets."""
    if key == "activation_mode":
        return _ACTIVATION_FIELDS[value]
    return {HYPER_TO_PARALLEL.get(key, key): value}


def check_agreement(config: TrainConfig, elsewhere: list[Translation]) -> None:
    """Values a DeepSpeed file fixes (other than 'auto') must be the YAML's, as HF Trainer requires."""
    for translation in elsewhere:
        for key, wanted in translation.agree.items():
            have = getattr(config, key)
            if have != wanted:
                raise ConfigError(f"{translation.source}: sets {key} to {wanted!r}, but the config has {key} = "
                                  f"{have!r}: expected 'auto' in the file, or the same value in both")

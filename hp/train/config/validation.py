"""A configuration as read from YAML, checked whole and returned as a `TrainConfig`.

Why this module exists: a misspelt key, a learning rate PyYAML read as a
string, or a parallel layout that cannot run should cost nothing, and be
reported once, in the launching shell, before any worker starts. So every
key is checked here: each value by its rule (`hp.train.config.rules`), keys
hp train does not hold by LlamaFactory's table
(`hp.train.config.llamafactory_keys`), the sharding keys folded into one
strategy (`hp.train.config.parallel`), and then the rules between keys.
Every mistake found is listed at once, in one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from hp.train.config.cluster import cluster_section
from hp.train.config.hyper_parallel import checked_hyper_args
from hp.train.config.llamafactory_keys import verdict
from hp.train.config.parallel import (
    AUTO, ELSEWHERE_KEYS, check_agreement, check_auto, fold_strategy, parallel_section, sharding_elsewhere,
    with_recompute,
)
from hp.train.config.rules import RULES, check_value, one_of, unknown_key
from hp.parallel.strategy import Strategy
from hp.train.config.schema import PREFERENCE_STAGES, ConfigError, TrainConfig

_REQUIRED = ("model_name_or_path", "dataset", "output_dir")
_TOP_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig)
                  if f.name not in ("no_effect", "notes", "parallel_auto"))


def validate(raw: Mapping[str, Any] | None, *, base_dir: str | os.PathLike | None = None) -> TrainConfig:
    """Check a configuration (as read from YAML) and return it as a `TrainConfig`.

    `base_dir` is where a relative `hyper_parallel_args` JSON path is also
    looked for when it is not found from the current directory (`load_config`
    passes the config file's directory).

    >>> cfg = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "alpaca_en_demo",
    ...                 "output_dir": "out", "learning_rate": "1e-4", "parallel": {"dp": 2, "tp": 2}})
    >>> cfg.learning_rate, cfg.nproc_per_node, cfg.parallel.tp
    (0.0001, 4, 2)
    >>> validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "learnig_rate": 1e-4})
    Traceback (most recent call last):
    ...
    hp.train.config.schema.ConfigError: unknown key 'learnig_rate' = 0.0001; did you mean 'learning_rate'?
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config is {type(raw).__name__} {raw!r}: expected a mapping of keys to values")
    problems: list[ConfigError] = []
    foreign = {key: verdict(key, value, raw.get("stage", TrainConfig.stage)) if isinstance(key, str) else None
               for key, value in raw.items() if key not in _TOP_KEYS}  # LlamaFactory keys hp takes no setting from
    for key, value in raw.items():
        if key in foreign and (foreign[key] is None or not foreign[key].accepted):
            problems.append(ConfigError(foreign[key].message) if foreign[key] else unknown_key(key, value, _TOP_KEYS))
    problems += [ConfigError(f"missing required key {key!r}: expected {RULES[key].allowed}")
                 for key in _REQUIRED if raw.get(key) is None]
    values = {key: _noting(problems, check_value, key, raw[key], rule) for key, rule in RULES.items() if key in raw}
    if values.get("dataset"):
        values["dataset"] = ",".join(name.strip() for name in values["dataset"].split(","))
    auto = raw.get("parallel") == AUTO
    given = _noting(problems, parallel_section, None if auto else raw.get("parallel"))
    hyper = _noting(problems, checked_hyper_args, raw, values.get("use_hyper_parallel", False), base_dir)
    elsewhere = _noting(problems, sharding_elsewhere, raw, base_dir)
    if auto:
        _noting(problems, check_auto, raw, hyper, elsewhere)
    trackers = _noting(problems, _report_to, raw.get("report_to"))
    values["cluster"] = _noting(problems, cluster_section, raw.get("cluster"))
    if problems:
        raise _together(problems)
    strategy, notes = fold_strategy(given, hyper, elsewhere, values)
    values["parallel"] = with_recompute(strategy, given, hyper, elsewhere,
                                        values.get("disable_gradient_checkpointing", False))
    values["hyper_parallel_args"] = None if hyper is None else MappingProxyType(hyper)
    values["parallel_auto"] = auto
    said = tuple(found.message for found in foreign.values() if found and found.accepted and found.message)
    values["report_to"], values["notes"] = trackers[0], said + notes + trackers[1] + _unset_notes(raw) + _cluster_notes(raw)
    values.update({key: MappingProxyType(dict(raw[key])) if isinstance(raw[key], Mapping) else raw[key]
                   for key in ELSEWHERE_KEYS if raw.get(key) is not None})
    values["no_effect"] = MappingProxyType({k: found.kept for k, found in foreign.items() if found})
    config = TrainConfig(**values)
    _check_training(config)
    check_agreement(config, elsewhere)
    return dataclasses.replace(config, nproc_per_node=_workers_per_node(config))


def _noting(problems: list[ConfigError], check: Callable, *args: Any) -> Any:
    """`check(*args)`, or None with its ConfigError added to `problems`: a config's mistakes are listed together."""
    try:
        return check(*args)
    except ConfigError as e:
        problems.append(e)
        return None


def _together(problems: list[ConfigError]) -> ConfigError:
    """One ConfigError listing every problem (one alone keeps its own words)."""
    if len(problems) == 1:
        return problems[0]
    return ConfigError(f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems))


def _cluster_notes(raw: Mapping[str, Any]) -> tuple[str, ...]:
    if raw.get("cluster") is None:
        return ()
    if raw.get("parallel") == AUTO:
        return ("cluster: hp train reads its device for parallel: auto only, and launches nproc_per_node workers on "
                "each of nnodes",)
    return ("cluster: read by hp plan only; hp train launches on the world its parallel degrees and nnodes give",)


def _unset_notes(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """Where an unset key means something else in LlamaFactory, and hp cannot follow it yet."""
    if "finetuning_type" in raw:
        return ()
    note = ("finetuning_type unset: LlamaFactory's default is lora; hp train's is full (every weight trains); set "
            "finetuning_type: lora for adapters")
    return (note,)


TRACKERS = ("tensorboard",)  # what report_to can name and hp train writes
# HF Trainer's other integrations: accepted, and said to be left out.
_OTHER_TRACKERS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "mlflow", "neptune",
                   "swanlab", "trackio", "wandb")


def _report_to(value: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """HF's report_to (a name, a list of them, "none" or "all") as the names, and notes for those hp leaves out."""
    if value is None or value == "none":
        return (), ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"report_to = {value!r}: expected a tracker's name, a list of them, 'none' or 'all'")
    if "all" in names:
        names = list(TRACKERS)
    unknown = [n for n in names if n not in TRACKERS + _OTHER_TRACKERS + ("none",)]
    if unknown:
        raise ConfigError(f"report_to = {value!r}: {', '.join(map(repr, unknown))} is not a tracker HF Trainer knows; "
                          f"expected {one_of(TRACKERS + _OTHER_TRACKERS)}, 'none' or 'all'")
    left_out = [n for n in names if n in _OTHER_TRACKERS]
    note = (f"report_to: {', '.join(left_out)} {'is' if len(left_out) == 1 else 'are'} not written to; hp train "
            "writes output_dir/metrics.jsonl, and TensorBoard events with report_to: tensorboard")
    notes = (note,) if left_out else ()
    return tuple(n for n in dict.fromkeys(names) if n != "none"), notes



def _check_training(config: TrainConfig) -> None:
    """Rules between keys."""
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        raise ConfigError(f"num_train_epochs = {config.num_train_epochs} with max_steps = {config.max_steps}: nothing "
                          "would train; expected num_train_epochs > 0 or max_steps > 0")
    if config.warmup_ratio > 0 and config.lr_scheduler_type == "constant":
        raise ConfigError(f"warmup_ratio = {config.warmup_ratio} with lr_scheduler_type = 'constant': the constant "
                          "schedule has no warmup; expected warmup_ratio 0, or lr_scheduler_type 'constant_with_warmup'")
    if config.node_rank >= config.nnodes:
        raise ConfigError(f"node_rank = {config.node_rank}: expected an integer in [0, nnodes = {config.nnodes})")
    if config.evaluates and not (config.val_size or config.eval_dataset):
        raise ConfigError(f"eval_strategy = {config.eval_strategy!r} (do_eval = {config.do_eval}) has nothing to evaluate "
                          "on: expected val_size > 0 or eval_dataset")
    if config.freeze_vision_tower and config.freeze_multi_modal_projector and config.freeze_language_model:
        raise ConfigError("freeze_language_model = True with freeze_vision_tower and freeze_multi_modal_projector "
                          "(their defaults) leaves nothing to train; set one of them to false")
    if config.val_size and config.eval_dataset:
        raise ConfigError(f"val_size = {config.val_size:g} with eval_dataset = {config.eval_dataset!r}: expected one "
                          "of them (a held-out split, or datasets of its own)")
    _check_preference(config)
    _check_pipeline(config)
    _check_placement(config)
    check_tp2d_rows(config, config.parallel)


def check_tp2d_rows(config: TrainConfig, strategy: Strategy) -> None:
    """Under 2D tensor parallel a batch's rows split over the tp2d axes (`hp.parallel.tp2d`): each rank's
    rows, of a training micro-batch and of an evaluation batch, must be a multiple of what they need.
    `strategy` is the config's, or the one its `scheme: auto` became for the model."""
    t2 = strategy.tp2d
    if t2 is None or t2.scheme == "auto":
        return
    rows = {"per_device_train_batch_size": config.per_device_train_batch_size // strategy.microbatches}
    if config.evaluates:
        rows["per_device_eval_batch_size"] = config.per_device_eval_batch_size
    for key, n in rows.items():
        if n % t2.rows:
            per = f" per micro-batch (/ pp_microbatches = {strategy.microbatches})" if strategy.pp > 1 and \
                key.endswith("train_batch_size") else ""
            raise ConfigError(f"{key} = {getattr(config, key)}: parallel.tp2d ({t2.scheme} on "
                              f"{', '.join(f'{a}={size}' for a, size in t2.mesh_axes.items())}) splits each rank's "
                              f"{n} rows{per} over its axes; expected a multiple of {t2.rows}")


def _check_pipeline(config: TrainConfig) -> None:
    """What `hp train` runs under pipeline parallel: language modelling, one stage per rank, whole micro-batches."""
    p = config.parallel
    if p.pp == 1 or p.mpmd_place is not None:
        return
    if config.stage not in ("pt", "sft"):
        raise ConfigError(f"parallel.pp = {p.pp} with stage = {config.stage!r}: hp train pipelines the pt and sft "
                          "stages so far; leave pp out for the preference stages")
    if p.stages_per_rank > 1:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r} runs {p.stages_per_rank} stages per rank; hp "
                          "train runs one stage per rank so far: expected GPipe or 1F1B")
    rows = config.per_device_train_batch_size * p.dp
    if rows % p.microbatches:
        raise ConfigError(f"parallel.pp_microbatches = {p.microbatches}: a step's batch of per_device_train_batch_size "
                          f"* dp = {config.per_device_train_batch_size} * {p.dp} = {rows} rows does not cut into "
                          "that many micro-batches; expected a divisor of it")


def _check_placement(config: TrainConfig) -> None:
    """What `hp train` runs under `parallel.mpmd.place` (`hp.mpmd`'s levels 2 and 3): a vision tower in the sft
    stage, DPO's or KTO's reference in the dpo or kto stage."""
    place = config.parallel.mpmd_place
    if place is None:
        return
    if place.program == "vision" and config.stage != "sft":
        raise ConfigError(f"parallel.mpmd.place.vision with stage = {config.stage!r}: hp train places a "
                          "vision-language model's tower in the sft stage; leave mpmd.place out")
    if place.program == "reference":
        _check_placed_reference(config, place.where)
    if place.program == "vision" and place.own_ranks and config.freeze_vision_tower and \
            config.freeze_multi_modal_projector:
        raise ConfigError(f"parallel.mpmd.place.vision = {place.where} with the tower and projector frozen (their "
                          "defaults): its own ranks would have nothing to train; place it in the pipeline's bubbles "
                          "(vision: pp), where a frozen tower runs a batch ahead, or unfreeze it")


def _check_placed_reference(config: TrainConfig, where) -> None:
    """The reference runs as a program of the losses that compare with one: DPO's (but SimPO and ORPO) and KTO's."""
    named = f"parallel.mpmd.place.reference = {where!r}"
    if config.stage == "kto" and config.parallel.dp > 1:
        raise ConfigError(f"{named} with stage = 'kto' and parallel.dp = {config.parallel.dp}: KTO's reference point "
                          "is the mean over a whole batch's mismatched pairs, which no replica holds; expected "
                          "parallel.dp: 1")
    if config.stage not in ("dpo", "kto"):
        raise ConfigError(f"{named} with stage = {config.stage!r}: that stage has no reference model to place; "
                          "expected stage: dpo or kto")
    if config.stage == "dpo" and not config.preference.uses_reference:
        raise ConfigError(f"{named} with pref_loss = {config.pref_loss!r}: that loss compares with no reference "
                          "model; leave mpmd.place out")


def _check_preference(config: TrainConfig) -> None:
    """What the preference stages cannot take yet, and preference keys set where nothing reads them."""
    if config.stage not in PREFERENCE_STAGES:
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        given = [f"{key} = {getattr(config, key)!r}" for key in _PREFERENCE_KEYS if getattr(config, key) != defaults[key]]
        if given:
            raise ConfigError(f"{', '.join(given)} with stage = {config.stage!r}: the preference keys act in stages "
                              f"{', '.join(PREFERENCE_STAGES)} only; expected their defaults, or a preference stage")
        return
    if config.evaluates:
        raise ConfigError(f"stage = {config.stage!r} with evaluation (eval_strategy = {config.eval_strategy!r}, do_eval "
                          f"= {config.do_eval}): evaluating a preference stage is not available yet; its rewards and "
                          "accuracies are reported for the training batches. Expected eval_strategy: 'no', do_eval: "
                          "false")
    if config.stage == "dpo" and config.ref_model is not None and not config.preference.uses_reference:
        raise ConfigError(f"ref_model = {config.ref_model!r} with pref_loss = {config.pref_loss!r}: that loss needs no "
                          "reference model; expected ref_model: null")
    if config.stage == "rm" and config.ref_model is not None:
        raise ConfigError(f"ref_model = {config.ref_model!r} with stage = 'rm': a reward model has no reference; "
                          "expected ref_model: null")


_PREFERENCE_KEYS = ("pref_beta", "pref_ftx", "pref_loss", "dpo_label_smoothing", "simpo_gamma", "kto_chosen_weight",
                    "kto_rejected_weight", "ref_model")


def _workers_per_node(config: TrainConfig) -> int:
    """nproc_per_node, derived from the parallel degrees when not given; they must agree."""
    p = config.parallel
    degrees = {"pp": p.pp, "dp": p.dp, "cp": p.cp, **(p.tp2d.mesh_axes if p.tp2d else {"tp": p.tp})}
    shown = {k: n for k, n in degrees.items() if k != "pp" or n > 1}
    ranks = f"{'*'.join(shown)} = {'*'.join(map(str, shown.values()))} = {p.world_size}"
    if p.mpmd_place is not None:  # the pipeline's ranks and the placed program's own, times dp and tp
        own, times = p.mpmd_place.own_ranks, {k: n for k, n in (("dp", p.dp), ("tp", p.tp)) if n > 1}
        ranks = f"pp + mpmd.place's own ranks = {p.pp} + {own} = {p.world_size}" if not times else \
            (f"(pp + mpmd.place's own ranks) * {' * '.join(times)} = ({p.pp} + {own}) * "
             f"{' * '.join(map(str, times.values()))} = {p.world_size}")
    if config.nproc_per_node is None:
        if p.world_size % config.nnodes:
            raise ConfigError(f"nnodes = {config.nnodes}: the {ranks} ranks do not split evenly over the nodes; "
                              f"expected a divisor of {p.world_size}")
        return p.world_size // config.nnodes
    if config.nnodes * config.nproc_per_node != p.world_size:
        per_node = p.world_size / config.nnodes
        wanted = f"{int(per_node)}" if per_node == int(per_node) else f"nnodes * nproc_per_node = {p.world_size}"
        raise ConfigError(f"nproc_per_node = {config.nproc_per_node}: expected {wanted}, as nnodes * nproc_per_node "
                          f"must equal {ranks} (or leave nproc_per_node out to derive it)")
    return config.nproc_per_node

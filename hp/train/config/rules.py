"""What each key of a training config takes, and how a refused or unknown key is told.

Why this module exists: the checks of the keys are data, one `Rule` a key
(its type, its range or choices, and the words that say what is allowed),
so that the messages read alike and a new key is one line. The top-level
keys are in `RULES`, the `parallel:` section's in `PARALLEL_RULES`;
`check_value` converts one value (YAML 1.1 reads 1e-4 as a string, so
numeric strings count as numbers) or refuses it, and `unknown_key` names the
closest known key for a misspelt one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hp.parallel.strategy import CP_ALGORITHMS, DTYPES, PP_SCHEDULES

from hp.train.config.schema import (
    ACTIVATION_MODES, DEVICES, EVAL_STRATEGIES, FINETUNING_TYPES, PREF_LOSSES, RESUME_LAST, SCHEDULERS, STAGES,
    TEMPLATES, ConfigError,
)


@dataclass(frozen=True)
class Rule:
    """What one key takes: its type, and a test with the words that say what the test allows."""

    kind: str  # "str", "int", "float", "bool" or "mapping"; "text": a string kept as written, not stripped
    test: Callable[[Any], bool] | None = None
    allowed: str = ""
    optional: bool = False  # null is a value
    choices: tuple[str, ...] = ()


def nonempty(v: str) -> bool:
    return bool(v.strip())


def _dataset_names(v: str) -> bool:
    return all(name.strip() for name in v.split(","))


RULES: dict[str, Rule] = {
    "model_name_or_path": Rule("str", nonempty, "a model directory or name"),
    "stage": Rule("str", choices=STAGES, allowed="(LlamaFactory's ppo is not available yet)"),
    "pref_beta": Rule("float", lambda v: v > 0, "a number > 0"),
    "pref_ftx": Rule("float", lambda v: v >= 0, "a number >= 0 (0: no language-modelling loss added)"),
    "pref_loss": Rule("str", choices=PREF_LOSSES, allowed="(LlamaFactory's bco_pair, sppo_hard and nca_pair are not "
                      "available yet)"),
    "dpo_label_smoothing": Rule("float", lambda v: 0 <= v <= 0.5, "a number in [0, 0.5]"),
    "simpo_gamma": Rule("float"),
    "kto_chosen_weight": Rule("float", lambda v: v > 0, "a number > 0"),
    "kto_rejected_weight": Rule("float", lambda v: v > 0, "a number > 0"),
    "ref_model": Rule("str", nonempty, "a model directory, or null for model_name_or_path", optional=True),
    "do_train": Rule("bool", lambda v: v, "true (only training is available yet)"),
    "trust_remote_code": Rule("bool"),
    "image_max_pixels": Rule("int", lambda v: v >= 32 * 32,
                             "an integer >= 1024 (LlamaFactory's image_min_pixels, the one hp train takes)"),
    "finetuning_type": Rule("str", choices=FINETUNING_TYPES),
    "lora_rank": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "lora_alpha": Rule("float", lambda v: v > 0, "a number > 0, or null for 2 * lora_rank", optional=True),
    "lora_dropout": Rule("float", lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "lora_target": Rule("str", _dataset_names, "'all', or comma-separated module names such as 'q_proj,v_proj'"),
    "additional_target": Rule("str", _dataset_names, "comma-separated module names, or null", optional=True),
    "use_rslora": Rule("bool"),
    "freeze_trainable_layers": Rule("int", lambda v: v != 0,
                                    "a non-zero integer (n > 0: the last n layers train; n < 0: the first -n)"),
    "freeze_trainable_modules": Rule("str", _dataset_names, "'all', or comma-separated module names such as 'mlp'"),
    "freeze_extra_modules": Rule("str", _dataset_names, "comma-separated module names, or null", optional=True),
    "freeze_vision_tower": Rule("bool"),
    "freeze_multi_modal_projector": Rule("bool"),
    "freeze_language_model": Rule("bool"),
    "weight_decay": Rule("float", lambda v: v >= 0, "a number >= 0"),
    "max_grad_norm": Rule("float", lambda v: v > 0, "a number > 0, or null for no clipping", optional=True),
    "dataset": Rule("str", _dataset_names, "comma-separated dataset names, such as 'alpaca_en_demo,identity'"),
    "dataset_dir": Rule("str", nonempty, "a directory"),
    "template": Rule("str", choices=TEMPLATES, optional=True),
    "default_system": Rule("text", optional=True),
    "train_on_prompt": Rule("bool"),
    "mask_history": Rule("bool"),
    "enable_thinking": Rule("bool", optional=True),
    "preserve_thinking": Rule("bool"),
    "cutoff_len": Rule("int", lambda v: v >= 2, "an integer >= 2"),
    "preprocessing_num_workers": Rule("int", lambda v: v >= 1, "an integer >= 1, or null for one process", optional=True),
    "dataloader_num_workers": Rule("int", lambda v: v >= 0, "an integer >= 0"),
    "max_samples": Rule("int", lambda v: v >= 1, "an integer >= 1, or null for every record", optional=True),
    "val_size": Rule("float", lambda v: v == 0 or 0 < v < 1 or (v >= 1 and v == int(v)),
                     "a fraction in (0, 1), a whole number of examples >= 1, or 0 for none"),
    "eval_dataset": Rule("str", _dataset_names, "comma-separated dataset names, or null", optional=True),
    "do_eval": Rule("bool"),
    "eval_strategy": Rule("str", choices=EVAL_STRATEGIES),
    "eval_steps": Rule("int", lambda v: v >= 1, "an integer >= 1, or null for logging_steps", optional=True),
    "per_device_eval_batch_size": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "output_dir": Rule("str", nonempty, "a directory"),
    "overwrite_output_dir": Rule("bool"),
    "logging_steps": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "save_steps": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "save_total_limit": Rule("int", lambda v: v >= 1, "an integer >= 1, or null to keep every checkpoint", optional=True),
    "save_only_model": Rule("bool"),
    "async_save": Rule("bool"),
    "ddp_timeout": Rule("int", lambda v: v >= 1, "a number of seconds >= 1"),
    "plot_loss": Rule("bool"),
    "logging_dir": Rule("str", nonempty, "a directory, or null for output_dir/runs", optional=True),
    "resume_from_checkpoint": Rule("str", nonempty, f"a checkpoint directory, {RESUME_LAST!r}, or null", optional=True),
    "per_device_train_batch_size": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "learning_rate": Rule("float", lambda v: v > 0, "a number > 0"),
    "num_train_epochs": Rule("float", lambda v: v >= 0, "a number >= 0"),
    "max_steps": Rule("int", lambda v: v >= -1, "a positive integer, or -1 to let num_train_epochs decide"),
    "lr_scheduler_type": Rule("str", choices=SCHEDULERS),
    "warmup_ratio": Rule("float", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "bf16": Rule("bool"),
    "disable_gradient_checkpointing": Rule("bool"),
    "torch_compile": Rule("bool"),
    "seed": Rule("int", lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    "use_hyper_parallel": Rule("bool"),
    "hyper_parallel_cp_size": Rule("int", lambda v: v >= 1, "an integer >= 1, or null for hyper_parallel_args' cp_size",
                                   optional=True),
    "nproc_per_node": Rule("int", lambda v: v >= 1, "an integer >= 1, or null for dp*cp*tp / nnodes", optional=True),
    "nnodes": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "max_restarts": Rule("int", lambda v: v >= 0, "an integer >= 0 (restarts from the last complete checkpoint)"),
    "node_rank": Rule("int", lambda v: v >= 0, "an integer >= 0"),
    "master_addr": Rule("str", nonempty, "a host name or address"),
    "master_port": Rule("int", lambda v: 1 <= v <= 65535, "a port in [1, 65535], or null for a free one",
                        optional=True),
    "device": Rule("str", choices=DEVICES),
}

PARALLEL_RULES: dict[str, Rule] = {
    "dp": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "tp": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp_algorithm": Rule("str", choices=CP_ALGORITHMS),
    "sp": Rule("bool"),
    "ep": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "expert_bias_rate": Rule("float", lambda v: v >= 0, "a number >= 0 (the routing bias's step per optimizer step; "
                             "0: none)"),
    "tp2d": Rule("mapping", allowed="{x: N, y: N, z: N (3d only), scheme: 2d | summa | 3d | auto}, or null",
                 optional=True),
    "fsdp": Rule("bool"),
    "offload": Rule("str", optional=True),
    "offload_budget": Rule("float", lambda v: 0 < v <= 1, "a fraction of the step's recorded peak memory, in (0, 1]"),
    "recompute": Rule("bool"),
    "compile": Rule("bool"),
    "vision_tp": Rule("bool"),
    "activation_mode": Rule("str", choices=ACTIVATION_MODES),
    "reshard_after_forward": Rule("bool"),
    "param_dtype": Rule("str", choices=DTYPES, optional=True),
    "reduce_dtype": Rule("str", choices=DTYPES, optional=True),
    "mpmd": Rule("chunks", lambda v: v == "auto" or v >= 1, "a number of chunks >= 1, 'auto', {chunks: N}, "
                 "{place: {vision: pp or N}}, {place: {reference: pp or N}} (with zero_bubble: true, the pipeline's backward split), "
                 "or null (hp.mpmd pipelines the step's collectives over that many "
                 "chunks, or places sub-models on ranks of their own)", optional=True),
    "pp": Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "pp_schedule": Rule("str", choices=tuple(PP_SCHEDULES)),
    "pp_microbatches": Rule("int", lambda v: v >= 1, "an integer >= 1, or null (one per stage)", optional=True),
    "pp_stages_per_rank": Rule("int", lambda v: v >= 1, "an integer >= 1, or null (what the schedule takes)",
                               optional=True),
    "pp_split": Rule("ints", lambda v: all(n >= 1 for n in v), "a list of blocks per stage, each >= 1, or null "
                     "(balanced by cost)", optional=True),
}

# parallel.mpmd.place: the sub-models placed (its keys and values are checked by hp.parallel.placement)
PLACE_RULE = Rule("mapping", allowed="a mapping of sub-models to where they run, e.g. {vision: pp}")

# LlamaFactory's HyperParallel keys that name a parallel degree, and that degree.
HYPER_TO_PARALLEL = {"tp_size": "tp", "cp_size": "cp", "ep_size": "ep"}

_KINDS = {"mapping": "a mapping", "str": "a string", "text": "a string", "int": "an integer", "ints": "a list of integers", "chunks": "a number of chunks, or 'auto'",
          "float": "a finite number (1e-4 and 0.0001 both work)", "bool": "true or false"}
_WRONG = object()  # what _convert returns for a value of the wrong type


def refuse(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: expected {allowed}")


def check_value(key: str, value: Any, rule: Rule) -> Any:
    """`value` converted to the rule's type, or ConfigError naming `key`."""
    if value is None:
        if rule.optional:
            return None
        raise refuse(key, value, _KINDS[rule.kind] if not rule.choices else one_of(rule.choices))
    converted = _convert(value, rule.kind)
    if converted is _WRONG:
        kind = _KINDS[rule.kind] + (", or null" if rule.optional else "")
        if rule.kind == "mapping" and rule.allowed:  # its shape says more than "a mapping"
            kind = rule.allowed
        raise refuse(key, value, one_of(rule.choices) if rule.choices else kind)
    if rule.choices and converted not in rule.choices:
        note = f" {rule.allowed}" if rule.allowed else ""
        raise refuse(key, value, one_of(rule.choices) + note)
    if rule.test is not None and not rule.test(converted):
        raise refuse(key, value, rule.allowed)
    return converted


def _convert(value: Any, kind: str) -> Any:
    if kind == "chunks":  # a count, or "auto"
        return value if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)) else _WRONG
    if kind == "bool":
        return value if isinstance(value, bool) else _WRONG
    if kind == "mapping":  # its keys are checked by the value it becomes
        return dict(value) if isinstance(value, Mapping) else _WRONG
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else _WRONG
    if kind == "ints":  # a list of counts, as written in YAML
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return tuple(value) if ok else _WRONG
    if kind in ("str", "text"):  # text: as written (a system prompt's spaces and newlines are tokens)
        return (value.strip() if kind == "str" else value) if isinstance(value, str) else _WRONG
    # float: YAML 1.1 reads 1e-4 (no dot) as a string, so numeric strings count
    if isinstance(value, bool):
        return _WRONG
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return _WRONG
    else:
        return _WRONG
    return number if math.isfinite(number) else _WRONG


def one_of(choices: Sequence[str]) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


# Names people reach for, and the key that holds them.
_ALIASES = {
    "lr": "learning_rate", "epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size",
    "max_length": "cutoff_len", "max_seq_length": "cutoff_len", "seq_len": "cutoff_len", "model": "model_name_or_path",
    "scheduler": "lr_scheduler_type", "warmup": "warmup_ratio", "resume": "resume_from_checkpoint",
}


def check_keys(given: Mapping, known: Sequence[str], section: str) -> None:
    """Raise `unknown_key`'s error for the first key of `given` not in `known` (a section's keys, `section` their
    prefix such as "parallel.")."""
    for key, value in given.items():
        if key not in known:
            raise unknown_key(key, value, known, section)


def unknown_key(key: Any, value: Any, known: Sequence[str], section: str = "") -> ConfigError:
    """ConfigError for a key that is not in `known`, with the closest known key."""
    name = f"{section}{key}"
    hint = None
    if not isinstance(key, str):
        hint = "keys are names"
    elif not section and key in PARALLEL_RULES:
        hint = f"did you mean 'parallel.{key}'? (degrees go in the parallel: section)"
    elif section != "hyper_parallel_args." and key in HYPER_TO_PARALLEL:
        hint = f"did you mean 'parallel.{HYPER_TO_PARALLEL[key]}'? ({key} is a hyper_parallel_args key)"
    elif section != "hyper_parallel_args." and key == "fsdp_size":
        hint = "did you mean 'parallel.dp' with 'parallel.fsdp: true'? (fsdp_size is a hyper_parallel_args key)"
    elif not section and key in _ALIASES:
        hint = f"did you mean {_ALIASES[key]!r}?"
    else:
        # a likely typo, not any look-alike (section keys are short: a letter weighs more)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6 if section else 0.8)
        if close:
            hint = f"did you mean {section + close[0]!r}?"
    if hint is None and section:
        return ConfigError(f"unknown key {name!r} = {value!r}; expected one of {', '.join(known)}")
    if hint is None:
        return ConfigError(f"unknown key {name!r} = {value!r}: neither a key hp train takes nor one of LlamaFactory's "
                           "it knows (docs/train.md lists the keys)")
    return ConfigError(f"unknown key {name!r} = {value!r}; {hint}")


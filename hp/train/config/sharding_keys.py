"""DeepSpeed's and HF Trainer's sharding settings, read as `hp.Strategy` fields.

LlamaFactory configs often shard the model outside the YAML: `deepspeed:`
names a DeepSpeed JSON (its ZeRO stage, offload, AutoTP), and HF Trainer's
`fsdp:` / `fsdp_config:` keys switch on FSDP. hp shards by its own strategy,
so each of those is translated here into the strategy fields that do the same
thing to the model, with a one-line note saying what was made of it. What has
no counterpart in hp yet (offloading to CPU or NVMe, hybrid sharding, an
optimizer defined in the DeepSpeed file) is refused by name; DeepSpeed's
tuning knobs (bucket sizes, prefetch depths, overlap switches) change speed,
not results, and are passed over. Like the config, this module imports no
torch.

How they map (world = every launched rank; dp = world / (cp * tp)):

    ZeRO-0, fsdp: no_shard          data parallel, parameters replicated
    ZeRO-1, ZeRO-2, shard_grad_op   FSDP over dp with reshard_after_forward: false
                                    (gradients and optimizer state sharded, parameters
                                    kept gathered from forward to backward)
    ZeRO-3, fsdp: full_shard        FSDP over dp
    tensor_parallel.autotp_size     tp
    fsdp_config.activation_checkpointing   recompute
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["AUTO", "ShardingKeyError", "Translation", "from_deepspeed", "from_hf_fsdp", "read_json"]

AUTO = "auto"  # DeepSpeed's "fill this from the training arguments"

# DeepSpeed's top-level sections that only tune speed or logging, or that the other keys cover.
_DS_PASSED_OVER = frozenset({
    "_comment", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print",
    "wall_clock_breakdown", "comms_config", "monitor_config", "communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "flops_profiler", "memory_breakdown", "dump_state", "activation_checkpointing",
})
# DeepSpeed's sections that must agree with a training key, and that key.
_DS_TRAINING = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                "gradient_accumulation_steps": "gradient_accumulation_steps",
                "gradient_clipping": "max_grad_norm"}
_DS_OFFLOAD = ("offload_optimizer", "offload_param")
# DeepSpeed's sections that are read here, besides those.
_DS_READ = frozenset({*_DS_PASSED_OVER, *_DS_TRAINING, "train_batch_size", "fp16", "bf16", "zero_optimization",
                      "tensor_parallel"})

# HF Trainer's fsdp options: what each sets (None: refused, with why).
_FSDP_OPTIONS: dict[str, dict[str, Any] | str] = {
    "full_shard": {"fsdp": True},
    "shard_grad_op": {"fsdp": True, "reshard_after_forward": False},
    "no_shard": {"fsdp": False},
    "auto_wrap": {},  # hp wraps every decoder block anyway
    "hybrid_shard": "hybrid sharding (FSDP within a node, replicas across nodes) is not available yet",
    "hybrid_shard_zero2": "hybrid sharding (FSDP within a node, replicas across nodes) is not available yet",
    "offload": "offloading parameters to the CPU is not available yet",
}
# fsdp_config keys (HF accepts them with or without the fsdp_ prefix) that change nothing in hp.
_FSDP_CONFIG_PASSED_OVER = frozenset({
    "version", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "min_num_params", "backward_prefetch",
    "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading",
    "state_dict_type", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
})


class ShardingKeyError(ValueError):
    """A DeepSpeed or HF FSDP setting hp cannot honour; the message names the key, the file and why."""


@dataclass(frozen=True)
class Translation:
    """What one source of sharding settings asks of the strategy.

    `fields` are `hp.Strategy` fields; `agree` are training keys whose values
    the source also fixes (DeepSpeed's micro-batch, say), checked by the config
    against the YAML's; `note` is the line the launcher prints.
    """

    source: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    agree: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))
        object.__setattr__(self, "agree", MappingProxyType(dict(self.agree)))


def read_json(key: str, value: Any, base_dir: str | os.PathLike | None) -> tuple[dict[str, Any], str]:
    """(the JSON object, where it came from) for a key given as a mapping or as a JSON file's path.

    A relative path is looked for from the current directory, then from
    `base_dir` (the config file's directory).

    >>> read_json("deepspeed", {"zero_optimization": {"stage": 3}}, None)
    ({'zero_optimization': {'stage': 3}}, 'deepspeed')
    >>> read_json("deepspeed", "no/ds.json", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hp.train.config.sharding_keys.ShardingKeyError: deepspeed = 'no/ds.json': expected the path of a JSON file, ...
    """
    if isinstance(value, Mapping):
        return dict(value), key
    if not isinstance(value, (str, os.PathLike)):
        raise ShardingKeyError(f"{key} = {value!r}: expected a mapping, or the path of a JSON file holding one")
    tried = [Path(value)]
    if base_dir is not None and not Path(value).is_absolute():
        tried.append(Path(base_dir) / value)
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        raise ShardingKeyError(f"{key} = {str(value)!r}: expected the path of a JSON file, but there is no file at "
                               f"{' or '.join(str(p) for p in tried)}")
    try:
        loaded = json.loads(found.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardingKeyError(f"{key} = {str(value)!r}: {found} does not read as JSON ({err})") from None
    if not isinstance(loaded, dict):
        raise ShardingKeyError(f"{key} = {str(value)!r}: expected a JSON object in {found}, found "
                               f"{type(loaded).__name__}")
    return loaded, f"{key} ({found.name})"


def from_deepspeed(value: Any, base_dir: str | os.PathLike | None = None) -> Translation:
    """The strategy a DeepSpeed config (a mapping or a JSON path, as LlamaFactory's `deepspeed:`) stands for.

    >>> t = from_deepspeed({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}})
    >>> dict(t.fields), t.note
    ({'fsdp': True}, 'deepspeed: ZeRO-3 runs as FSDP over the data-parallel ranks')
    >>> from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    Traceback (most recent call last):
    ...
    hp.train.config.sharding_keys.ShardingKeyError: deepspeed: zero_optimization.offload_optimizer = {'device': 'cpu'}: offloading to the CPU or NVMe is not available yet (parallel.offload: disk moves saved activations and AdamW's states by a plan of its own; DeepSpeed's CPU and NVMe sections are not mapped onto it); expected no offload section, or device 'none'
    """
    ds, source = read_json("deepspeed", value, base_dir)
    unknown = sorted(k for k in ds if k not in _DS_READ)
    if unknown:
        raise ShardingKeyError(f"{source}: {', '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} no "
                               "counterpart in hp train (its optimizer is AdamW, its schedule lr_scheduler_type); "
                               "expected DeepSpeed's zero_optimization, precision and batch settings only")
    if ds.get("train_batch_size", AUTO) != AUTO:
        raise ShardingKeyError(f"{source}: train_batch_size = {ds['train_batch_size']!r}: expected 'auto' (hp derives "
                               "the global batch from per_device_train_batch_size, gradient_accumulation_steps and dp)")
    agree = {train_key: ds[key] for key, train_key in _DS_TRAINING.items() if ds.get(key, AUTO) != AUTO}
    agree.update(_ds_precision(ds, source))
    stage, fields = _zero_stage(ds.get("zero_optimization") or {}, source)
    tp = (ds.get("tensor_parallel") or {}).get("autotp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ShardingKeyError(f"{source}: tensor_parallel.autotp_size = {tp!r}: expected an integer >= 1")
    words = {0: "ZeRO-0 runs as plain data parallel",
             1: "ZeRO-1 runs as FSDP with reshard_after_forward false",
             2: "ZeRO-2 runs as FSDP with reshard_after_forward false",
             3: "ZeRO-3 runs as FSDP over the data-parallel ranks"}[stage]
    if tp > 1:
        fields["tp"] = tp
        words += f", AutoTP as tp = {tp}"
    return Translation(source, fields, agree, f"{source}: {words}")


def _zero_stage(zero: Any, source: str) -> tuple[int, dict[str, Any]]:
    if not isinstance(zero, Mapping):
        raise ShardingKeyError(f"{source}: zero_optimization = {zero!r}: expected a mapping")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ShardingKeyError(f"{source}: zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
    for key in _DS_OFFLOAD:
        offload = zero.get(key)
        if offload and (not isinstance(offload, Mapping) or offload.get("device", "none") != "none"):
            raise ShardingKeyError(f"{source}: zero_optimization.{key} = {offload!r}: offloading to the CPU or NVMe "
                                   "is not available yet (parallel.offload: disk moves saved activations and AdamW's states by a plan of its own; DeepSpeed's CPU and NVMe sections are not mapped onto it); expected no offload section, "
                                   "or device 'none'")
    fields = {0: {}, 1: {"fsdp": True, "reshard_after_forward": False},
              2: {"fsdp": True, "reshard_after_forward": False}, 3: {"fsdp": True}}[stage]
    return stage, dict(fields)


def _ds_precision(ds: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The bf16 switch the DeepSpeed file fixes (fp16 on is refused: only bf16 mixed precision is available)."""
    fp16 = (ds.get("fp16") or {}).get("enabled", AUTO)
    if fp16 not in (AUTO, False):
        raise ShardingKeyError(f"{source}: fp16.enabled = {fp16!r}: only bf16 mixed precision is available; "
                               "expected 'auto' or false")
    bf16 = (ds.get("bf16") or {}).get("enabled", AUTO)
    return {} if bf16 == AUTO else {"bf16": bool(bf16)}


def from_hf_fsdp(fsdp: Any, fsdp_config: Any = None, base_dir: str | os.PathLike | None = None) -> Translation:
    """The strategy HF Trainer's `fsdp` option string (or list) and `fsdp_config` stand for.

    >>> t = from_hf_fsdp("full_shard auto_wrap", {"activation_checkpointing": True})
    >>> dict(t.fields)
    {'fsdp': True, 'recompute': True}
    >>> from_hf_fsdp("hybrid_shard")
    Traceback (most recent call last):
    ...
    hp.train.config.sharding_keys.ShardingKeyError: fsdp = 'hybrid_shard': hybrid sharding (FSDP within a node, replicas across nodes) is not available yet
    """
    options = fsdp.split() if isinstance(fsdp, str) else list(fsdp or [])
    fields: dict[str, Any] = {}
    for option in options:
        what = _FSDP_OPTIONS.get(option)
        if what is None:
            raise ShardingKeyError(f"fsdp = {fsdp!r}: {option!r} is not one of HF Trainer's fsdp options "
                                   f"({', '.join(_FSDP_OPTIONS)})")
        if isinstance(what, str):
            raise ShardingKeyError(f"fsdp = {fsdp!r}: {what}")
        fields.update(what)
    if fsdp_config is not None:
        fields.update(_fsdp_config(fsdp_config, base_dir))
    words = ("FSDP over the data-parallel ranks" if fields.get("fsdp") else "plain data parallel")
    if fields.get("reshard_after_forward") is False:
        words += " with reshard_after_forward false"
    if fields.get("recompute"):
        words += ", with activation recompute"
    return Translation("fsdp", fields, {}, f"fsdp: runs as {words}")


def _fsdp_config(value: Any, base_dir: str | os.PathLike | None) -> dict[str, Any]:
    config, source = read_json("fsdp_config", value, base_dir)
    fields: dict[str, Any] = {}
    for key, setting in config.items():
        name = key.removeprefix("fsdp_") if isinstance(key, str) else key
        if name in _FSDP_CONFIG_PASSED_OVER:
            continue
        if name == "reshard_after_forward":
            fields["reshard_after_forward"] = _flag(setting, source, key)
        elif name == "activation_checkpointing":
            fields["recompute"] = _flag(setting, source, key)
        elif name == "offload_params" and not _flag(setting, source, key):
            continue
        elif name == "offload_params":
            raise ShardingKeyError(f"{source}: {key} = {setting!r}: offloading parameters to the CPU is not available "
                                   "yet; expected false")
        else:
            raise ShardingKeyError(f"{source}: {key} = {setting!r} has no counterpart in hp train; expected only "
                                   "reshard_after_forward, activation_checkpointing, offload_params: false, and "
                                   "FSDP's wrapping and prefetch settings")
    return fields


def _flag(value: Any, source: str, key: str) -> bool:
    """HF writes these switches as booleans or as the strings 'true' / 'false'."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ShardingKeyError(f"{source}: {key} = {value!r}: expected true or false")

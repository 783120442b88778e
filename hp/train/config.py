"""The configuration of `hp train`: one YAML file, checked whole before any worker starts.

Why this module exists: a training run spends its first minutes launching
workers, building the mesh and loading weights. A misspelt key, a learning
rate PyYAML read as a string, or a parallel layout the model zoo cannot take
should cost nothing, and should be reported once, in the launching shell, not
N times from N ranks. So the whole file is read, command-line overrides are
applied, and every key is checked here, in plain Python: this module imports
neither torch nor torch.distributed and does no distributed work. What comes
out is a frozen `TrainConfig` whose values are already of the right type and
range, and whose `parallel` is the `hp.Strategy` that the launcher, the
trainer and the model plans take (`hp.Strategy` checks the parallel rules
themselves; this module says where a refused value came from).

The keys are LlamaFactory's (`model_name_or_path`, `stage`, `dataset`,
`cutoff_len`, `learning_rate`, ...), plus a `parallel:` section (dp, tp, cp,
sp, fsdp, ...) and the launcher's keys (`nproc_per_node`, `nnodes`, ...).
LlamaFactory's HyperParallel switch (`use_hyper_parallel: true` with
`hyper_parallel_args`, a dict or a JSON file of tp_size, cp_size, ep_size,
fsdp_size, activation_mode, and for expert parallel efsdp_size,
token_dispatcher, ep_style, expert_module_cls, each honoured where hp does
the same thing) is read too and folded into `parallel`.

Every mistake raises `ConfigError` (a `ValueError`) whose message names the
key, the value given and what is allowed; an unknown key comes with the
closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from hp.parallel.finetune import Finetuning, Freeze, Lora
from hp.parallel.strategy import CP_ALGORITHMS, DEFAULTS, DTYPES, Strategy, StrategyError

from hp.train.llamafactory_keys import verdict
from hp.train.sharding_keys import (
    ShardingKeyError,
    Translation,
    from_deepspeed,
    from_hf_fsdp,
    read_json,
)
from hp.train.templates import TEMPLATE_NAMES

__all__ = [
    "ACTIVATION_MODES", "DEFAULT_MASTER_PORT", "DEVICES", "DTYPES", "EVAL_STRATEGIES", "SCHEDULERS", "STAGES", "TEMPLATES",
    "ConfigError", "TrainConfig",
    "apply_overrides", "load_config", "read_hyper_parallel_args", "strategy_labels", "to_dict", "validate",
]

FINETUNING_TYPES = ("full", "lora", "freeze")  # hp.train.finetuning
STAGES = ("pt", "sft", "rm", "dpo", "kto")  # training stages hp train runs (LlamaFactory's ppo is not here yet)
PAIRWISE_STAGES = ("rm", "dpo")  # stages that read chosen/rejected pairs (`ranking: true` datasets)
PREFERENCE_STAGES = ("rm", "dpo", "kto")  # stages trained on judged answers (hp.train.objectives)
PREF_LOSSES = ("sigmoid", "hinge", "ipo", "simpo", "orpo")  # dpo's pref_loss (hp.train.preference)
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # pref_loss values that need no reference model
TEMPLATES = TEMPLATE_NAMES
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
EVAL_STRATEGIES = ("no", "steps", "epoch")
DEVICES = ("auto", "cpu", "cuda", "npu")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # HyperParallel's short spellings
ACTIVATION_MODES = ("none", "recompute", "swap")  # what LlamaFactory's HyperParallel does with activations
# The strategy fields each activation mode sets. HyperParallel swaps to host memory; here the slow tier is the
# disk, the one hp.offload has on every machine (the host tier for accelerators is not built yet).
_ACTIVATION_FIELDS = {"none": {}, "recompute": {"recompute": True}, "swap": {"offload": "disk"}}
DEFAULT_MASTER_PORT = 29500  # the rendezvous port of a run over several nodes when master_port is unset
RESUME_LAST = "last"  # resume_from_checkpoint: the newest complete checkpoint in output_dir


class ConfigError(ValueError):
    """A training configuration that cannot run: the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class Preference:
    """The preference stages' settings, with LlamaFactory's names and defaults (see `hp.train.preference`).

    >>> Preference(loss="simpo").uses_reference
    False
    """

    beta: float = 0.1  # pref_beta: the inverse temperature of the implicit reward (and SimPO's, ORPO's weight)
    loss: str = "sigmoid"  # pref_loss, one of PREF_LOSSES (dpo; kto has its own)
    ftx: float = 0.0  # pref_ftx: the weight of the chosen answers' language-modelling loss added to it
    label_smoothing: float = 0.0  # dpo_label_smoothing: sigmoid DPO's assumed rate of flipped preferences
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    kto_chosen_weight: float = 1.0  # KTO's weight of desirable answers
    kto_rejected_weight: float = 1.0  # KTO's weight of undesirable answers

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with a reference model (DPO's and KTO's do; SimPO and ORPO do not)."""
        return self.loss not in REFERENCE_FREE_LOSSES


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A checked training configuration (build it with `validate` or `load_config`).

    After validation `nproc_per_node` is always an int, `dataset` is the
    comma-separated names without spaces, and `hyper_parallel_args` is the
    read-only dict that was given (or read from its JSON file), already folded
    into `parallel`.
    """

    # model
    model_name_or_path: str  # HF model directory, or hp/tiny-llama
    trust_remote_code: bool = False  # accepted for LlamaFactory configs; hp builds models from local configs only
    # method
    stage: str = "sft"  # one of STAGES
    do_train: bool = True  # must be true: only training is available
    finetuning_type: str = "full"  # one of FINETUNING_TYPES (hp.train.finetuning)
    # lora: adapters on the linears lora_target names ("all": every linear of the decoder blocks)
    lora_rank: int = 8
    lora_alpha: float | None = None  # None: 2 * lora_rank
    lora_dropout: float = 0.0
    lora_target: str = "all"  # comma-separated module names, or "all"
    additional_target: str | None = None  # comma-separated modules trained in full beside the adapters
    use_rslora: bool = False  # scale by alpha / sqrt(rank) instead of alpha / rank
    # freeze: the last n decoder layers train (the first -n when negative), the modules named in them
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: str = "all"  # comma-separated names of a layer's modules (mlp, self_attn), or "all"
    freeze_extra_modules: str | None = None  # comma-separated modules outside the layers that train too
    # a vision-language model's parts that keep their weights (LlamaFactory's defaults: the tower and projector)
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = True
    freeze_language_model: bool = False
    # preference stages (rm, dpo, kto): LlamaFactory's keys, hp.train.config.Preference
    pref_beta: float = Preference.beta
    pref_ftx: float = Preference.ftx
    pref_loss: str = Preference.loss  # one of PREF_LOSSES
    dpo_label_smoothing: float = Preference.label_smoothing
    simpo_gamma: float = Preference.simpo_gamma
    kto_chosen_weight: float = Preference.kto_chosen_weight
    kto_rejected_weight: float = Preference.kto_rejected_weight
    ref_model: str | None = None  # the reference model's directory; None: model_name_or_path (under LoRA: adapters off)
    # dataset
    dataset: str  # comma-separated dataset names
    dataset_dir: str = "data"
    template: str | None = None  # one of TEMPLATES; None: the tokenizer's own chat_template, else "empty"
    default_system: str | None = None  # replaces the template's default system prompt; None: the template's own
    train_on_prompt: bool = False  # sft: the prompts are supervised too (not with an efficient_eos template)
    mask_history: bool = False  # sft: only the last answer is supervised; cutoff_len keeps the last turns first
    enable_thinking: bool | None = True  # reasoning templates (qwen3): false drops thoughts, the empty one not learnt
    preserve_thinking: bool = False  # reasoning templates: with mask_history, earlier answers keep their thoughts
    cutoff_len: int = 2048  # tokens per sequence, at most
    max_samples: int | None = None  # keep the first that many records of each dataset; null: all
    preprocessing_num_workers: int | None = None  # processes that tokenize the datasets; None: this one
    dataloader_num_workers: int = 0  # processes that collate batches ahead of the step; 0: the training process
    val_size: float = 0.0  # held out of the training data for evaluation: a fraction in (0, 1), or a count >= 1
    eval_dataset: str | None = None  # comma-separated dataset names to evaluate on instead of a held-out split
    # evaluation (as HF Trainer: eval_strategy decides when; do_eval alone evaluates once, at the end)
    do_eval: bool = False
    eval_strategy: str = "no"  # one of EVAL_STRATEGIES
    eval_steps: int | None = None  # with eval_strategy "steps"; None: logging_steps
    per_device_eval_batch_size: int = 8
    # output
    output_dir: str
    overwrite_output_dir: bool = False
    logging_steps: int = 500
    save_steps: int = 500
    save_total_limit: int | None = None  # None: keep every checkpoint
    save_only_model: bool = False  # checkpoints without optimizer state: smaller, but they cannot be resumed
    plot_loss: bool = False
    report_to: tuple[str, ...] = ()  # experiment trackers (HF's names); hp writes "tensorboard", notes the others
    logging_dir: str | None = None  # where TensorBoard events go; None: output_dir/runs
    resume_from_checkpoint: str | None = None  # None, a checkpoint directory, or "last"
    # train
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    num_train_epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides num_train_epochs; -1 (or 0): the epochs decide
    lr_scheduler_type: str = "linear"  # one of SCHEDULERS
    warmup_ratio: float = 0.0  # in [0, 1)
    weight_decay: float = 0.0  # AdamW's
    max_grad_norm: float | None = 1.0  # gradient clipping (HF Trainer's default); null: none
    bf16: bool = False
    seed: int = 42
    disable_gradient_checkpointing: bool = False  # LlamaFactory recomputes each block's activations unless this
    torch_compile: bool = False  # LlamaFactory's name for parallel.compile: blocks and loss under torch.compile
    # parallel
    parallel: Strategy = field(default_factory=Strategy)
    use_hyper_parallel: bool = False
    hyper_parallel_args: Mapping[str, Any] | None = None
    hyper_parallel_cp_size: int | None = None  # LlamaFactory's override of hyper_parallel_args' cp_size
    # sharding set the DeepSpeed or HF Trainer way (hp.train.sharding_keys), folded into `parallel`
    deepspeed: str | Mapping[str, Any] | None = None  # a DeepSpeed JSON path, or its mapping
    fsdp: str | list[str] | None = None  # HF Trainer's fsdp options, such as "full_shard auto_wrap"
    fsdp_config: str | Mapping[str, Any] | None = None
    fsdp_transformer_layer_cls_to_wrap: str | list[str] | None = None  # HF's older spelling; hp wraps every block
    # launch
    nproc_per_node: int | None = None  # None: dp * cp * tp / nnodes
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one node, DEFAULT_MASTER_PORT over several
    ddp_timeout: int = 1800  # seconds a collective may wait for the other ranks
    device: str = "auto"  # one of DEVICES
    # LlamaFactory keys that change nothing here, as given (hp.train.llamafactory_keys; the launcher prints why)
    no_effect: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # what the launcher says of how the config was written: keys without effect, sharding from elsewhere
    # (DeepSpeed, HF fsdp, HyperParallel), defaults that differ from LlamaFactory's
    notes: tuple[str, ...] = field(default=(), compare=False)  # messages about how it was written, not the config

    @property
    def finetuning(self) -> Finetuning:
        """What trains, as finetuning_type and its keys say."""
        names = lambda v: tuple(n.strip() for n in v.split(",")) if v else ()  # noqa: E731
        if self.finetuning_type == "lora":
            lora = Lora(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                        targets=names(self.lora_target), rslora=self.use_rslora, extra=names(self.additional_target))
            return Finetuning(lora=lora)
        if self.finetuning_type == "freeze":
            return Finetuning(freeze=Freeze(self.freeze_trainable_layers, names(self.freeze_trainable_modules),
                                            names(self.freeze_extra_modules)))
        return Finetuning()

    @property
    def preference(self) -> Preference:
        """The preference stages' settings."""
        return Preference(self.pref_beta, self.pref_loss, self.pref_ftx, self.dpo_label_smoothing, self.simpo_gamma,
                          self.kto_chosen_weight, self.kto_rejected_weight)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The dataset names, in order."""
        return tuple(self.dataset.split(","))

    @property
    def evaluates(self) -> bool:
        """Whether the run computes an evaluation loss (every eval_steps, every epoch, or once at the end)."""
        return self.eval_strategy != "no" or self.do_eval

    @property
    def world_size(self) -> int:
        """Worker processes over all nodes: nnodes * nproc_per_node."""
        return self.nnodes * (self.nproc_per_node or 0)


# ---------------------------------------------------------------- key rules

@dataclass(frozen=True)
class _Rule:
    """What one key takes: its type, and a test with the words that say what the test allows."""

    kind: str  # "str", "int", "float" or "bool"; "text": a string kept as written, not stripped
    test: Callable[[Any], bool] | None = None
    allowed: str = ""
    optional: bool = False  # null is a value
    choices: tuple[str, ...] = ()


def _nonempty(v: str) -> bool:
    return bool(v.strip())


def _dataset_names(v: str) -> bool:
    return all(name.strip() for name in v.split(","))


_RULES: dict[str, _Rule] = {
    "model_name_or_path": _Rule("str", _nonempty, "a model directory or name"),
    "stage": _Rule("str", choices=STAGES, allowed="(LlamaFactory's ppo is not available yet)"),
    "pref_beta": _Rule("float", lambda v: v > 0, "a number > 0"),
    "pref_ftx": _Rule("float", lambda v: v >= 0, "a number >= 0 (0: no language-modelling loss added)"),
    "pref_loss": _Rule("str", choices=PREF_LOSSES, allowed="(LlamaFactory's bco_pair, sppo_hard and nca_pair are not "
                       "available yet)"),
    "dpo_label_smoothing": _Rule("float", lambda v: 0 <= v <= 0.5, "a number in [0, 0.5]"),
    "simpo_gamma": _Rule("float"),
    "kto_chosen_weight": _Rule("float", lambda v: v > 0, "a number > 0"),
    "kto_rejected_weight": _Rule("float", lambda v: v > 0, "a number > 0"),
    "ref_model": _Rule("str", _nonempty, "a model directory, or null for model_name_or_path", optional=True),
    "do_train": _Rule("bool", lambda v: v, "true (only training is available yet)"),
    "trust_remote_code": _Rule("bool"),
    "finetuning_type": _Rule("str", choices=FINETUNING_TYPES),
    "lora_rank": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "lora_alpha": _Rule("float", lambda v: v > 0, "a number > 0, or null for 2 * lora_rank", optional=True),
    "lora_dropout": _Rule("float", lambda v: 0 <= v < 1, "a probability in [0, 1)"),
    "lora_target": _Rule("str", _dataset_names, "'all', or comma-separated module names such as 'q_proj,v_proj'"),
    "additional_target": _Rule("str", _dataset_names, "comma-separated module names, or null", optional=True),
    "use_rslora": _Rule("bool"),
    "freeze_trainable_layers": _Rule("int", lambda v: v != 0,
                                     "a non-zero integer (n > 0: the last n layers train; n < 0: the first -n)"),
    "freeze_trainable_modules": _Rule("str", _dataset_names, "'all', or comma-separated module names such as 'mlp'"),
    "freeze_extra_modules": _Rule("str", _dataset_names, "comma-separated module names, or null", optional=True),
    "freeze_vision_tower": _Rule("bool"),
    "freeze_multi_modal_projector": _Rule("bool"),
    "freeze_language_model": _Rule("bool"),
    "weight_decay": _Rule("float", lambda v: v >= 0, "a number >= 0"),
    "max_grad_norm": _Rule("float", lambda v: v > 0, "a number > 0, or null for no clipping", optional=True),
    "dataset": _Rule("str", _dataset_names, "comma-separated dataset names, such as 'alpaca_en_demo,identity'"),
    "dataset_dir": _Rule("str", _nonempty, "a directory"),
    "template": _Rule("str", choices=TEMPLATES, optional=True),
    "default_system": _Rule("text", optional=True),
    "train_on_prompt": _Rule("bool"),
    "mask_history": _Rule("bool"),
    "enable_thinking": _Rule("bool", optional=True),
    "preserve_thinking": _Rule("bool"),
    "cutoff_len": _Rule("int", lambda v: v >= 2, "an integer >= 2"),
    "preprocessing_num_workers": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null for one process", optional=True),
    "dataloader_num_workers": _Rule("int", lambda v: v >= 0, "an integer >= 0"),
    "max_samples": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null for every record", optional=True),
    "val_size": _Rule("float", lambda v: v == 0 or 0 < v < 1 or (v >= 1 and v == int(v)),
                      "a fraction in (0, 1), a whole number of examples >= 1, or 0 for none"),
    "eval_dataset": _Rule("str", _dataset_names, "comma-separated dataset names, or null", optional=True),
    "do_eval": _Rule("bool"),
    "eval_strategy": _Rule("str", choices=EVAL_STRATEGIES),
    "eval_steps": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null for logging_steps", optional=True),
    "per_device_eval_batch_size": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "output_dir": _Rule("str", _nonempty, "a directory"),
    "overwrite_output_dir": _Rule("bool"),
    "logging_steps": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "save_steps": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "save_total_limit": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null to keep every checkpoint", optional=True),
    "save_only_model": _Rule("bool"),
    "ddp_timeout": _Rule("int", lambda v: v >= 1, "a number of seconds >= 1"),
    "plot_loss": _Rule("bool"),
    "logging_dir": _Rule("str", _nonempty, "a directory, or null for output_dir/runs", optional=True),
    "resume_from_checkpoint": _Rule("str", _nonempty, f"a checkpoint directory, {RESUME_LAST!r}, or null", optional=True),
    "per_device_train_batch_size": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "learning_rate": _Rule("float", lambda v: v > 0, "a number > 0"),
    "num_train_epochs": _Rule("float", lambda v: v >= 0, "a number >= 0"),
    "max_steps": _Rule("int", lambda v: v >= -1, "a positive integer, or -1 to let num_train_epochs decide"),
    "lr_scheduler_type": _Rule("str", choices=SCHEDULERS),
    "warmup_ratio": _Rule("float", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "bf16": _Rule("bool"),
    "disable_gradient_checkpointing": _Rule("bool"),
    "torch_compile": _Rule("bool"),
    "seed": _Rule("int", lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    "use_hyper_parallel": _Rule("bool"),
    "hyper_parallel_cp_size": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null for hyper_parallel_args' cp_size",
                                    optional=True),
    "nproc_per_node": _Rule("int", lambda v: v >= 1, "an integer >= 1, or null for dp*cp*tp / nnodes", optional=True),
    "nnodes": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "node_rank": _Rule("int", lambda v: v >= 0, "an integer >= 0"),
    "master_addr": _Rule("str", _nonempty, "a host name or address"),
    "master_port": _Rule("int", lambda v: 1 <= v <= 65535, "a port in [1, 65535], or null for a free one",
                         optional=True),
    "device": _Rule("str", choices=DEVICES),
}

_PARALLEL_RULES: dict[str, _Rule] = {
    "dp": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "tp": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp_algorithm": _Rule("str", choices=CP_ALGORITHMS),
    "sp": _Rule("bool"),
    "ep": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "expert_bias_rate": _Rule("float", lambda v: v >= 0, "a number >= 0 (the routing bias's step per optimizer step; "
                              "0: none)"),
    "tp2d": _Rule("bool", optional=True),
    "fsdp": _Rule("bool"),
    "offload": _Rule("str", optional=True),
    "offload_budget": _Rule("float", lambda v: 0 < v <= 1, "a fraction of the step's recorded peak memory, in (0, 1]"),
    "recompute": _Rule("bool"),
    "compile": _Rule("bool"),
    "vision_tp": _Rule("bool"),
    "activation_mode": _Rule("str", choices=ACTIVATION_MODES),
    "reshard_after_forward": _Rule("bool"),
    "param_dtype": _Rule("str", choices=DTYPES, optional=True),
    "reduce_dtype": _Rule("str", choices=DTYPES, optional=True),
    "mpmd": _Rule("chunks", lambda v: v == "auto" or v >= 1, "a number of chunks >= 1, 'auto', {chunks: N}, or null "
                  "(hp.mpmd pipelines the step's collectives over that many chunks)", optional=True),
}

# LlamaFactory's HyperParallel keys, and the parallel key each one sets.
_HYPER_RULES: dict[str, _Rule] = {
    "tp_size": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "cp_size": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "ep_size": _Rule("int", lambda v: v >= 1, "an integer >= 1"),
    "fsdp_size": _Rule("int", lambda v: v >= 1, "an integer >= 1 (the ranks FSDP shards over: dp * cp)"),
    "activation_mode": _Rule("str", choices=ACTIVATION_MODES),
    # HyperParallel's swap also moves each block's inputs unless this is false; hp.offload's planner decides per
    # saved tensor, block inputs among them, so the key is taken and changes nothing
    "activation_swap_inputs": _Rule("bool"),
    "reshard_after_forward": _Rule("bool"),
    "param_dtype": _Rule("str", choices=DTYPES + tuple(_DTYPE_ALIASES)),
    "reduce_dtype": _Rule("str", choices=DTYPES + tuple(_DTYPE_ALIASES)),
    # HyperParallel's expert parallel: honoured where hp does the same thing, refused otherwise
    "efsdp_size": _Rule("int", lambda v: v >= 1, "an integer >= 1 (the ranks FSDP shards each expert over: "
                        "dp / ep * cp), or null", optional=True),
    "token_dispatcher": _Rule("str", choices=("all_to_all",), allowed=(
        "(hp sends each token to its experts' ranks with one all-to-all of uneven splits over ep, HyperParallel's "
        "'all_to_all'; the two-stage 'deredundency' dispatch is not available)")),
    "ep_style": _Rule("str", choices=("ep",), allowed=(
        "(hp splits whole experts over ep and keeps each expert whole over tp, whose ranks hold the same tokens: "
        "HyperParallel's 'ep'; experts split over tp are not available)")),
    "expert_module_cls": _Rule("str", _nonempty, "the class name of the model's MoE block or experts module "
                               "(checked against the model before any worker starts)"),
}
_HYPER_TO_PARALLEL = {"tp_size": "tp", "cp_size": "cp", "ep_size": "ep"}
# hyper_parallel_args keys that set no strategy field by themselves: checked once the strategy is known
# (fsdp_size: dp and fsdp; efsdp_size: against the strategy; expert_module_cls: against the model, in preflight)
_HYPER_CHECKED = ("fsdp_size", "efsdp_size", "token_dispatcher", "ep_style", "expert_module_cls",
                  "activation_swap_inputs")
# HyperParallel keys hp knows but cannot honour yet, and why.
_HYPER_NOT_YET = {
    "plan_overrides": "hp's model plans are data of each family in hp.models; a run does not override them",
}


_KINDS = {"str": "a string", "text": "a string", "int": "an integer", "chunks": "a number of chunks, or 'auto'",
          "float": "a finite number (1e-4 and 0.0001 both work)", "bool": "true or false"}


_WRONG = object()  # what _convert returns for a value of the wrong type


def _refuse(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: expected {allowed}")


def _check(key: str, value: Any, rule: _Rule) -> Any:
    """`value` converted to the rule's type, or ConfigError naming `key`."""
    if value is None:
        if rule.optional:
            return None
        raise _refuse(key, value, _KINDS[rule.kind] if not rule.choices else _one_of(rule.choices))
    converted = _convert(value, rule.kind)
    if converted is _WRONG:
        kind = _KINDS[rule.kind] + (", or null" if rule.optional else "")
        raise _refuse(key, value, _one_of(rule.choices) if rule.choices else kind)
    if rule.choices and converted not in rule.choices:
        note = f" {rule.allowed}" if rule.allowed else ""
        raise _refuse(key, value, _one_of(rule.choices) + note)
    if rule.test is not None and not rule.test(converted):
        raise _refuse(key, value, rule.allowed)
    return converted


def _convert(value: Any, kind: str) -> Any:
    if kind == "chunks":  # a count, or "auto"
        return value if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)) else _WRONG
    if kind == "bool":
        return value if isinstance(value, bool) else _WRONG
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else _WRONG
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


def _one_of(choices: Sequence[str]) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


# Names people reach for, and the key that holds them.
_ALIASES = {
    "lr": "learning_rate", "epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size",
    "max_length": "cutoff_len", "max_seq_length": "cutoff_len", "seq_len": "cutoff_len", "model": "model_name_or_path",
    "scheduler": "lr_scheduler_type", "warmup": "warmup_ratio", "resume": "resume_from_checkpoint",
}


def _unknown(key: Any, value: Any, known: Sequence[str], section: str = "") -> ConfigError:
    """ConfigError for a key that is not in `known`, with the closest known key."""
    name = f"{section}{key}"
    hint = None
    if not isinstance(key, str):
        hint = "keys are names"
    elif not section and key in _PARALLEL_RULES:
        hint = f"did you mean 'parallel.{key}'? (degrees go in the parallel: section)"
    elif section != "hyper_parallel_args." and key in _HYPER_TO_PARALLEL:
        hint = f"did you mean 'parallel.{_HYPER_TO_PARALLEL[key]}'? ({key} is a hyper_parallel_args key)"
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
                           "it knows (the README lists the keys)")
    return ConfigError(f"unknown key {name!r} = {value!r}; {hint}")


# ---------------------------------------------------------------- validation

_REQUIRED = ("model_name_or_path", "dataset", "output_dir")
_SECTIONS = ("parallel", "hyper_parallel_args")
_TOP_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("no_effect", "notes"))


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
    hp.train.config.ConfigError: unknown key 'learnig_rate' = 0.0001; did you mean 'learning_rate'?
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
            problems.append(ConfigError(foreign[key].message) if foreign[key] else _unknown(key, value, _TOP_KEYS))
    problems += [ConfigError(f"missing required key {key!r}: expected {_RULES[key].allowed}")
                 for key in _REQUIRED if raw.get(key) is None]
    values = {key: _noting(problems, _check, key, raw[key], rule) for key, rule in _RULES.items() if key in raw}
    if values.get("dataset"):
        values["dataset"] = ",".join(name.strip() for name in values["dataset"].split(","))
    given = _noting(problems, _parallel_section, raw.get("parallel"))
    hyper = _noting(problems, _hyper_parallel, raw, values.get("use_hyper_parallel", False), base_dir)
    elsewhere = _noting(problems, _sharding_elsewhere, raw, base_dir)
    trackers = _noting(problems, _report_to, raw.get("report_to"))
    if problems:
        raise _together(problems)
    strategy, notes = _parallel(given, hyper, elsewhere, values)
    values["parallel"] = _with_recompute(strategy, given, hyper, elsewhere,
                                         values.get("disable_gradient_checkpointing", False))
    values["hyper_parallel_args"] = None if hyper is None else MappingProxyType(hyper)
    said = tuple(found.message for found in foreign.values() if found and found.accepted and found.message)
    values["report_to"], values["notes"] = trackers[0], said + notes + trackers[1] + _unset_notes(raw)
    values.update({key: MappingProxyType(dict(raw[key])) if isinstance(raw[key], Mapping) else raw[key]
                   for key in _ELSEWHERE_KEYS if raw.get(key) is not None})
    values["no_effect"] = MappingProxyType({k: found.kept for k, found in foreign.items() if found})
    config = TrainConfig(**values)
    _check_training(config)
    _check_agreement(config, elsewhere)
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


def _parallel_section(section: Any) -> dict[str, Any]:
    """The keys given in the `parallel:` section, checked (absent keys stay absent)."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise _refuse("parallel", section, "a mapping such as {dp: 2, tp: 2}")
    for key, value in section.items():
        if key not in _PARALLEL_RULES:
            raise _unknown(key, value, tuple(_PARALLEL_RULES), "parallel.")
    if isinstance(section.get("offload"), Mapping):
        section = {**section, **_offload_mapping(section["offload"], "offload_budget" in section)}
    if isinstance(section.get("mpmd"), Mapping):  # {chunks: N}
        if set(section["mpmd"]) - {"chunks"}:
            raise _refuse("parallel.mpmd", dict(section["mpmd"]), _PARALLEL_RULES["mpmd"].allowed)
        section = {**section, "mpmd": section["mpmd"].get("chunks", "auto")}
    return {key: _check(f"parallel.{key}", section[key], rule) for key, rule in _PARALLEL_RULES.items() if key in section}


def _offload_mapping(value: Mapping, budget_given: bool) -> dict[str, Any]:
    """`parallel.offload: {budget: 0.5, tiers: [device, disk]}` as the offload and offload_budget keys."""
    unknown = set(value) - {"budget", "tiers"}
    if unknown:
        raise _refuse("parallel.offload", dict(value), "a tier (disk) or a mapping of budget (a fraction of the "
                      f"step's peak) and tiers ([device, disk]); unknown key {sorted(unknown)[0]!r}")
    tiers = value.get("tiers", ["device", "disk"])
    if not isinstance(tiers, (list, tuple)) or len(tiers) != 2 or tiers[0] != "device":
        raise _refuse("parallel.offload.tiers", tiers, "[device, T] with T the slow tier (disk)")
    if budget_given and "budget" in value:
        raise ConfigError("parallel.offload.budget and parallel.offload_budget are both given: expected one of them")
    return {"offload": tiers[1], **({"offload_budget": value["budget"]} if "budget" in value else {})}


def _hyper_parallel(raw: Mapping[str, Any], enabled: bool, base_dir: str | os.PathLike | None) -> dict[str, Any] | None:
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
        raise _refuse("hyper_parallel_args", args, "a mapping of tp_size, cp_size, ep_size, fsdp_size, activation_mode, "
                      "or the path of a JSON file holding one")
    for key, value in args.items():
        if key in _HYPER_NOT_YET:
            raise ConfigError(f"hyper_parallel_args.{key} = {value!r} is not taken by hp train yet "
                              f"({_HYPER_NOT_YET[key]}); expected no {key} key")
        if key not in _HYPER_RULES:
            raise _unknown(key, value, tuple(_HYPER_RULES), "hyper_parallel_args.")
    checked = {key: _check(f"hyper_parallel_args.{key}", args[key], rule)
               for key, rule in _HYPER_RULES.items() if key in args}
    return {key: _DTYPE_ALIASES.get(value, value) if key.endswith("_dtype") else value for key, value in checked.items()}


def read_hyper_parallel_args(path: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The JSON object in `path` (relative: from the current directory, else from `base_dir`).

    >>> read_hyper_parallel_args("no/such.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hp.train.config.ConfigError: hyper_parallel_args = 'no/such.json': expected the path of a JSON file, ...
    """
    try:
        return read_json("hyper_parallel_args", path, base_dir)[0]
    except ShardingKeyError as e:
        raise ConfigError(str(e)) from None


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
                          f"expected {_one_of(TRACKERS + _OTHER_TRACKERS)}, 'none' or 'all'")
    left_out = [n for n in names if n in _OTHER_TRACKERS]
    note = (f"report_to: {', '.join(left_out)} {'is' if len(left_out) == 1 else 'are'} not written to; hp train "
            "writes output_dir/metrics.jsonl, and TensorBoard events with report_to: tensorboard")
    notes = (note,) if left_out else ()
    return tuple(n for n in dict.fromkeys(names) if n != "none"), notes


# sharding keys of DeepSpeed and HF Trainer (the last changes nothing: FSDP wraps every decoder block anyway)
_ELSEWHERE_KEYS = ("deepspeed", "fsdp", "fsdp_config", "fsdp_transformer_layer_cls_to_wrap")


def _sharding_elsewhere(raw: Mapping[str, Any], base_dir: str | os.PathLike | None) -> list[Translation]:
    """What DeepSpeed's or HF Trainer's sharding keys ask of the strategy (`hp.train.sharding_keys`)."""
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


class _Fold:
    """Strategy fields gathered from several keys, each remembered with the key that set it first."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.source: dict[str, str] = {}  # field -> "key = value" that set it

    def get(self, name: str) -> Any:
        return self.values.get(name, DEFAULTS[name])

    def add(self, label: str, fields: Mapping[str, Any]) -> None:
        for name, wanted in fields.items():
            if name in self.values and self.values[name] != wanted:
                raise ConfigError(f"{self.source[name]} conflicts with {label} (which sets {name} = {wanted!r}): "
                                  "expected the same value, or the degree set in one place")
            self.values[name] = wanted
            self.source.setdefault(name, label)

    def strategy(self) -> Strategy:
        try:
            return Strategy(**self.values)
        except StrategyError as e:
            label = self.source.get(e.key, f"parallel.{e.key} = {e.value!r}")
            raise ConfigError(f"{label}{e.problem}") from None


def _parallel(given: dict[str, Any], hyper: dict[str, Any] | None, elsewhere: list[Translation],
              values: Mapping[str, Any]) -> tuple[Strategy, tuple[str, ...]]:
    """The strategy the parallel section, hyper_parallel_args and DeepSpeed/HF fsdp keys ask for, and the notes.

    dp left unset takes the ranks cp and tp leave (nproc_per_node * nnodes / (cp * tp)), as a
    LlamaFactory run is data parallel over every launched rank.
    """
    fold, notes = _Fold(), []
    for key, value in given.items():
        fold.add(f"parallel.{key} = {value!r}", _strategy_fields(key, value))
    if hyper is not None:
        hyper, note = _hyper_cp_override(hyper, values.get("hyper_parallel_cp_size"))
        notes += [note] if note else []
        for key, value in hyper.items():
            if key not in _HYPER_CHECKED:
                fold.add(f"hyper_parallel_args.{key} = {value!r}", _strategy_fields(key, value))
    for translation in elsewhere:
        fold.add(translation.source, translation.fields)
        notes.append(translation.note)
    if values.get("torch_compile"):
        fold.add("torch_compile = True", {"compile": True})
    if hyper is not None and hyper.get("fsdp_size", 1) > 1:
        _hyper_fsdp_size(fold, hyper["fsdp_size"], values)
    _derive_dp(fold, values)
    if hyper is not None and "fsdp_size" not in hyper:
        notes += _hyper_fsdp_everywhere(fold)
    strategy = fold.strategy()
    if hyper is not None and hyper.get("efsdp_size") is not None:
        _hyper_efsdp_size(strategy, hyper["efsdp_size"], hyper.get("fsdp_size"))
    return strategy, tuple(notes)


def strategy_labels(config: TrainConfig) -> dict[str, str]:
    """The key each strategy field was written as, where it is not `parallel.FIELD` (for later messages).

    >>> strategy_labels(validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "o",
    ...                           "use_hyper_parallel": True, "hyper_parallel_args": {"tp_size": 2}}))
    {'tp': 'hyper_parallel_args.tp_size'}
    """
    hyper = config.hyper_parallel_args or {}
    return {name: f"hyper_parallel_args.{key}" for key, name in _HYPER_TO_PARALLEL.items() if key in hyper}


def _hyper_cp_override(hyper: dict[str, Any], cp_size: int | None) -> tuple[dict[str, Any], str]:
    """LlamaFactory's top-level hyper_parallel_cp_size replaces hyper_parallel_args' cp_size."""
    if cp_size is None:
        return hyper, ""
    note = ""
    if hyper.get("cp_size", cp_size) != cp_size:
        note = (f"hyper_parallel_cp_size = {cp_size} replaces hyper_parallel_args.cp_size = {hyper['cp_size']} "
                "(as LlamaFactory does)")
    return {**hyper, "cp_size": cp_size}, note


def _hyper_fsdp_size(fold: _Fold, size: int, values: Mapping[str, Any]) -> None:
    """HyperParallel's fsdp_size > 1: FSDP over that many dp * cp ranks, which must be all that tp leaves."""
    cp, tp = fold.get("cp"), fold.get("tp")
    label = f"hyper_parallel_args.fsdp_size = {size}"
    if size % cp:
        raise ConfigError(f"{label}: expected a multiple of cp = {cp} (FSDP shards over the dp * cp ranks)")
    fold.add(label, {"dp": size // cp, "fsdp": True})
    world = _world(values)
    if world is not None and size * tp != world:
        raise ConfigError(f"{label} with {world} ranks and tp = {tp}: FSDP over part of the ranks with replicas "
                          f"across the rest (HSDP) is not available yet; expected fsdp_size = {world // tp} "
                          "(the ranks tp leaves), or no fsdp_size")


def _hyper_efsdp_size(strategy: Strategy, size: int, fsdp_size: int | None) -> None:
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


def _hyper_fsdp_everywhere(fold: _Fold) -> list[str]:
    """HyperParallel's fsdp_size unset: FSDP over every dp * cp rank (LlamaFactory's default), when there are some."""
    ranks = fold.get("dp") * fold.get("cp")
    if ranks == 1:
        return []
    fold.add("use_hyper_parallel = True (fsdp_size unset: FSDP over every rank tp leaves; fsdp_size: 1 for none)",
             {"fsdp": True})
    return [f"use_hyper_parallel: FSDP over all {ranks} dp * cp ranks (fsdp_size unset, as in LlamaFactory)"]


def _world(values: Mapping[str, Any]) -> int | None:
    """Every launched rank, when nproc_per_node says it."""
    nproc = values.get("nproc_per_node")
    return None if nproc is None else nproc * values.get("nnodes", 1)


def _derive_dp(fold: _Fold, values: Mapping[str, Any]) -> None:
    """dp, when unset, from the launched ranks that cp and tp leave."""
    world = _world(values)
    if "dp" in fold.values or world is None:
        return
    inner = fold.get("cp") * fold.get("tp")
    launched = f"nproc_per_node = {values['nproc_per_node']} (x nnodes = {values.get('nnodes', 1)})"
    if world % inner:
        raise ConfigError(f"{launched}: {world} ranks do not split into groups of cp * tp = {inner}; expected a "
                          f"multiple of {inner}")
    dp, ep = world // inner, fold.get("ep")
    if dp % ep:
        ep_label = fold.source.get("ep", f"parallel.ep = {ep}")
        raise ConfigError(f"{ep_label} does not divide the data-parallel ranks: {launched} with cp = {fold.get('cp')} "
                          f"and tp = {fold.get('tp')} leaves dp = {world} / (cp * tp) = {dp}, and expert parallel "
                          f"splits the dp ranks into groups of ep; expected an ep that divides {dp}, or "
                          f"nproc_per_node * nnodes a multiple of ep * cp * tp = {ep * inner}")
    if dp > 1:
        fold.add(f"nproc_per_node = {values['nproc_per_node']}", {"dp": dp})


def _with_recompute(strategy: Strategy, given: dict[str, Any], hyper: dict[str, Any] | None,
                    elsewhere: list[Translation], disable: bool) -> Strategy:
    """Activation recompute as LlamaFactory has it: on unless disable_gradient_checkpointing or compiled blocks,
    or as parallel says."""
    explicit = ("recompute" in given or "offload" in given or "activation_mode" in given
                or "activation_mode" in (hyper or {})
                or any("recompute" in t.fields for t in elsewhere))
    if not explicit:
        return dataclasses.replace(strategy, recompute=not disable and not strategy.compile)
    if disable and strategy.recompute:
        raise ConfigError("disable_gradient_checkpointing = True conflicts with the parallel settings, which ask for "
                          "recompute (parallel.recompute, activation_mode: recompute or fsdp_config's "
                          "activation_checkpointing): expected one of them")
    return strategy


def _strategy_fields(key: str, value: Any) -> dict[str, Any]:
    """The strategy fields that one parallel or hyper_parallel_args key sets."""
    if key == "activation_mode":
        return _ACTIVATION_FIELDS[value]
    if key == "tp2d":
        return {"tp2d": bool(value)}
    return {_HYPER_TO_PARALLEL.get(key, key): value}


def _check_agreement(config: TrainConfig, elsewhere: list[Translation]) -> None:
    """Values a DeepSpeed file fixes (other than 'auto') must be the YAML's, as HF Trainer requires."""
    for translation in elsewhere:
        for key, wanted in translation.agree.items():
            have = getattr(config, key)
            if have != wanted:
                raise ConfigError(f"{translation.source}: sets {key} to {wanted!r}, but the config has {key} = "
                                  f"{have!r}: expected 'auto' in the file, or the same value in both")


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
    ranks = f"dp*cp*tp = {p.dp}*{p.cp}*{p.tp} = {p.world_size}"
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


# ---------------------------------------------------------------- files and overrides

class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last)."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise ConfigError(f"key {key!r} is given twice (line {seen[key] + 1} and line {key_node.start_mark.line + 1}): "
                              "expected each key once")
        if isinstance(key, (str, int, float, bool)):
            seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read the YAML file at `path`, apply `overrides` (``key=value``, ``parallel.tp=2``), and validate.

    Values of overrides are read as YAML, so ``bf16=true`` is a bool and
    ``parallel.tp=2`` an int; a value that is not YAML stays a string.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp, "sft.yaml")
    ...     _ = path.write_text("model_name_or_path: hp/tiny-llama\\ndataset: alpaca_en_demo\\noutput_dir: out\\n")
    ...     cfg = load_config(path, ["bf16=true", "parallel.tp=2"])
    >>> cfg.bf16, cfg.parallel.tp, cfg.nproc_per_node
    (True, 2, 2)
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist: expected the path of a YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"config file {str(path)!r} holds a {type(raw).__name__}: expected a mapping of keys to values")
    return validate(apply_overrides(raw or {}, overrides, base_dir=path.parent), base_dir=path.parent)


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str],
                    *, base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """A copy of `raw` with each ``key=value`` (or ``section.key=value``) of `overrides` set.

    A dotted key reaches into the `parallel` or `hyper_parallel_args` section
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
        if section not in _SECTIONS or not name or "." in name:
            raise ConfigError(f"override {override!r}: a dotted key is SECTION.KEY with SECTION one of "
                              f"{', '.join(_SECTIONS)}, such as parallel.tp=2")
        current = out.get(section)
        if section == "hyper_parallel_args" and isinstance(current, (str, os.PathLike)):
            current = read_hyper_parallel_args(current, base_dir)
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            raise ConfigError(f"override {override!r}: {section} = {current!r} is not a mapping to set {name!r} in")
        out[section] = {**current, name: value}
    return out


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain dicts, lists, strings, numbers and bools, for YAML or JSON in output_dir.

    `validate(to_dict(config))` gives `config` back.

    >>> cfg = validate({"model_name_or_path": "m", "dataset": "a, b", "output_dir": "o"})
    >>> d = to_dict(cfg)
    >>> d["dataset"], d["parallel"]["dp"], d["nproc_per_node"]
    ('a,b', 1, 1)
    >>> validate(d) == cfg
    True
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "no_effect":
            out.update(value)
            continue
        if f.name == "notes":
            continue
        if isinstance(value, Strategy):
            value = value.as_dict()
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out

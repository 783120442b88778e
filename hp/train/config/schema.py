"""What a training configuration is: the `TrainConfig` its YAML becomes, and the values its keys may take.

Why this module exists: every other part of `hp train` reads a config, and
none should need the rules that checked it. So the checked result is a
frozen dataclass whose values are already of the right type and range,
with LlamaFactory's key names and defaults, and whose `parallel` is the
`hp.Strategy` that the launcher, the trainer and the model plans take.
`ConfigError` is the one error a config that cannot run raises; its
message names the key, the value given and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hp.parallel.finetune import Finetuning, Freeze, Lora
from hp.parallel.strategy import Strategy

from hp.train.config.templates import TEMPLATE_NAMES

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
ACTIVATION_MODES = ("none", "recompute", "swap")  # what LlamaFactory's HyperParallel does with activations
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


@dataclass(frozen=True)
class Cluster:
    """The devices a run is planned for (`cluster:`, read by `hp plan`); None where the section leaves a value to
    `hp plan`'s flags. Checked by `hp.train.config.cluster`."""

    devices: int | None = None
    devices_per_node: int | None = None
    device: str | Mapping[str, Any] | None = None  # a profile's name, or its figures (hp.train.config.cluster)


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
    image_max_pixels: int = 768 * 768  # LlamaFactory's: larger pictures shrink to this area before the processor
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
    async_save: bool = True  # checkpoints written in the background while training goes on
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
    # `parallel: auto`: the hp command picks `parallel` by hp plan's search before the launch (hp.plan.auto); until
    # then `parallel` is plain data parallel over the launched ranks
    parallel_auto: bool = False
    use_hyper_parallel: bool = False
    hyper_parallel_args: Mapping[str, Any] | None = None
    hyper_parallel_cp_size: int | None = None  # LlamaFactory's override of hyper_parallel_args' cp_size
    # sharding set the DeepSpeed or HF Trainer way (hp.train.config.sharding_keys), folded into `parallel`
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
    max_restarts: int = 0  # times the workers restart from the last complete checkpoint after one dies
    device: str = "auto"  # one of DEVICES
    cluster: Cluster | None = None  # the machines `hp plan` plans for (hp.train.config.cluster); hp train reads none
    # LlamaFactory keys that change nothing here, as given (hp.train.config.llamafactory_keys; the launcher prints why)
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


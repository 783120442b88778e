"""What `hp train` does with each LlamaFactory key it does not take as a setting of its own.

Why this module exists: people bring configs written for `llamafactory-cli
train`, whose parser reads five argument sets (model, data, training with
all of HF's `Seq2SeqTrainingArguments`, finetuning, generation) with about
three hundred keys between them, many of which change nothing in an hp run
and some of which ask for features hp does not have. An unknown-key error
for each of them would make every such config fail for no good reason,
and passing over them silently would hide the ones that matter (a LoRA
rank, fp16, a second optimizer). So every one of those keys that
`hp.train.config.TrainConfig` does not hold (nor the config package itself,
for the keys it reads and maps, such as `deepspeed` or `template`) has a
verdict here, with the reason in a few words:

- accepted with a note: the key changes nothing in what hp trains (a
  download cache, a tracker, an inference engine, a kernel switch), so any
  value is taken, kept in `TrainConfig.no_effect`, and the launcher prints
  one line saying why it has no effect;
- refused: the key would change what is trained (an adapter, a precision, a
  loss, an optimizer, the data order), so a config giving it fails with the
  reason, every such key listed at once; except for the values listed as
  harmless (LlamaFactory's or HF's default, or what hp does anyway), which
  are accepted silently, so that a config spelling out a default never
  fails.

The table covers LlamaFactory's ModelArguments, DataArguments,
FinetuningArguments, GeneratingArguments and TrainingArguments (HF
Trainer's keys, from transformers 4.55 to 5.x, with LlamaFactory's Ray,
FP8 and profiler keys), its Megatron keys, the keys of its v1 config format
and of the Accelerate launch files its examples ship, so that each key of
its example configs has an answer. The table is data, and this module
imports neither torch nor the config, so a test can hold it against
LlamaFactory's and HF's argument lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["FOREIGN_KEYS", "HIDDEN", "ForeignKey", "Verdict", "verdict"]

HIDDEN = "<hidden>"  # what a note shows, and the config keeps, of a secret (an access token, an API key)


@dataclass(frozen=True)
class ForeignKey:
    """What hp train does with one LlamaFactory key: a note (any value) or a refusal (but for harmless values)."""

    reason: str  # printed in the note or in the refusal
    refused: bool  # False: any value is accepted, with the reason as a one-line note
    harmless: tuple = ()  # refused keys: values that change nothing here, accepted without a word
    harmless_in: tuple[tuple[str, tuple], ...] = ()  # (stage, values) harmless in that stage only
    secret: bool = False  # a token or key: never printed nor kept


@dataclass(frozen=True)
class Verdict:
    """The answer for one key and value: accepted or not, the line to print, and the value the config keeps."""

    accepted: bool
    message: str | None  # the refusal, or the note; None for a harmless value, accepted silently
    kept: Any = None  # accepted keys: the value for TrainConfig.no_effect (HIDDEN for a secret)


def verdict(key: str, value: Any, stage: str | None = None) -> Verdict | None:
    """What hp train does with `key` given as `value` in a config of training `stage`; None if the table lacks it.

    None means the key is not LlamaFactory's or is one that the config takes
    itself; the caller knows which. `stage` (pt, sft) decides the few keys
    whose harmless values depend on it; None: only the values harmless in
    every stage.

    >>> refused = verdict("fp16", True)
    >>> refused.accepted, refused.message.split("; ")[-1]
    (False, 'expected no fp16 key, or a value that changes nothing here: false')
    >>> verdict("fp16", False)
    Verdict(accepted=True, message=None, kept=False)
    >>> verdict("cache_dir", "/data/hf").message
    "cache_dir = '/data/hf' has no effect here (nothing is downloaded: models and datasets are read from local paths)"
    >>> verdict("hf_hub_token", "hf_abc").kept
    '<hidden>'
    >>> verdict("learning_rate", 1e-4) is None  # a TrainConfig field
    True
    """
    entry = FOREIGN_KEYS.get(key)
    if entry is None:
        return None
    harmless = entry.harmless + dict(entry.harmless_in).get(stage, ())
    if entry.refused and not any(_same(value, h) for h in harmless):
        allowed = f", or a value that changes nothing here: {', '.join(map(_yaml, harmless))}" if harmless else ""
        return Verdict(False, f"{key} = {value!r} is not taken by hp train ({entry.reason}); "
                              f"expected no {key} key{allowed}")
    kept = HIDDEN if entry.secret and value is not None else value
    if entry.refused:
        return Verdict(True, None, kept)
    return Verdict(True, f"{key} = {kept!r} has no effect here ({entry.reason})", kept)


def _same(value: Any, harmless: Any) -> bool:
    """`value` is `harmless`: bools only equal bools, and a number may be written as a string (YAML reads 1e-8 so)."""
    if isinstance(harmless, bool) or isinstance(value, bool):
        return value is harmless
    if isinstance(harmless, (int, float)) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    if isinstance(harmless, (int, float)) and isinstance(value, (int, float)):
        return math.isclose(value, harmless, rel_tol=1e-12, abs_tol=0.0)
    return type(value) is type(harmless) and value == harmless


def _yaml(value: Any) -> str:
    """A value as a YAML config writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    return repr(value)


# ---------------------------------------------------------------- helpers: one reason, many keys

def _refused(reason: str, defaults: Mapping[str, Any],
             also: Mapping[str, tuple] | None = None) -> dict[str, ForeignKey]:
    """Keys refused with `reason` unless at their default (LlamaFactory's or HF's), or at a value in `also`."""
    also = also or {}
    return {key: ForeignKey(reason, True, (default, *also.get(key, ()))) for key, default in defaults.items()}


def _noted(reason: str, *keys: str, secrets: tuple[str, ...] = ()) -> dict[str, ForeignKey]:
    """Keys accepted at any value, each with `reason` as its note (the values of `secrets` never shown)."""
    return {key: ForeignKey(reason, False, secret=key in secrets) for key in (*keys, *secrets)}


def _pointers(reason: str, where: Mapping[str, str]) -> dict[str, ForeignKey]:
    """Keys of another config format, refused with `reason` and the hp key that does their job."""
    return {key: ForeignKey(f"{reason}; {instead}", True) for key, instead in where.items()}


def _optimizer(name: str, defaults: Mapping[str, Any]) -> dict[str, ForeignKey]:
    return _refused(f"{name} is not available: hp train's optimizer is torch's AdamW", defaults)


_ADAPTERS = ("LoRA's variants (DoRA, PiSSA, LoRA+), OFT and loading or stacking trained adapters are not available "
             "yet: finetuning_type lora trains new plain LoRA adapters")
_PREFERENCE = ("PPO, BCO, LD-DPO, a reward model read while training, and reference adapters are not available yet: "
               "the preference stages are rm, dpo (pref_loss sigmoid, hinge, ipo, simpo, orpo) and kto")
_QUANTIZED = "quantized training is not available yet: weights are trained in fp32"
_MULTIMODAL = ("LlamaFactory's other image settings are not available yet: hp train reads images for Qwen2.5-VL and "
               "Qwen3-VL at image_max_pixels and their processor's pixel bounds")
_KTRANSFORMERS = "KTransformers (MoE experts on the CPU) is not available"
_FP8 = "FP8 training is not available: bf16: true is the only mixed precision"
_LOSS = "only the cross-entropy loss of the supervised tokens is available (DFT, ASFT and EAFT are not)"
_LOADER = ("batches are collated by torch's DataLoader with its defaults (dataloader_num_workers processes, or the "
           "training process); this changes speed, not which batches a step sees")
_GENERATION = ("hp train does not generate text (do_predict and predict_with_generate are not available), so "
               "decoding settings are not read")
_TRACKERS = "hp train writes output_dir/metrics.jsonl, and TensorBoard events with report_to: tensorboard"
_HUB = "nothing is uploaded: checkpoints stay in output_dir (hp export turns one into an HF model directory)"
_MEGATRON = "hp train does not run Megatron-Core"
_V1 = "a key of LlamaFactory v1's config format; hp train reads the llamafactory-cli train keys"
_ACCELERATE = ("a key of an Accelerate launch config, not of a training config; hp train starts its workers itself "
               "(nproc_per_node, nnodes, node_rank, master_addr, master_port)")

_TABLE: dict[str, ForeignKey] = {
    # ------------------------------------------------ model: the weights, tokenizer and attention
    **_noted("nothing is downloaded: models and datasets are read from local paths", "cache_dir"),
    **_noted("nothing is downloaded or uploaded", secrets=("hf_hub_token", "ms_hub_token", "om_hub_token")),
    **_refused("hp reads local model directories only, as they are: there is no revision to pick",
               {"model_revision": "main"}),
    **_noted("the tokenizer is loaded as AutoTokenizer loads it by default (the fast one when the directory has one)",
             "use_fast_tokenizer"),
    **_refused("changing the tokenizer's vocabulary and the embeddings is not available yet",
               {"resize_vocab": False, "add_tokens": None, "add_special_tokens": None,
                "new_special_tokens_config": None, "init_special_tokens": "noise_init"}),
    **_refused("special tokens written in the text are tokenized as special tokens; splitting them is not available",
               {"split_special_tokens": False}),
    **_noted("every rank builds the model on the meta device and reads only its own blocks of the weights",
             "low_cpu_mem_usage"),
    **_refused("the model's RoPE is taken as its config.json has it; set rope_scaling there",
               {"rope_scaling": None}),
    **_noted("attention follows the model's config (attn_implementation, SDPA unless it names another) and, under "
             "parallel.cp, hp's ring or Ulysses kernels; this key switches no FlashAttention on or off", "flash_attn"),
    **_refused("LongLoRA's shift short attention is not available", {"shift_attn": False}),
    **_refused("mixture-of-depths models are not available", {"mixture_of_depths": None}),
    **_refused("Unsloth is not available", {"use_unsloth": False}),
    **_noted("activations are recomputed per decoder block, in memory (disable_gradient_checkpointing, parallel: "
             "recompute); Unsloth's offloaded checkpointing is not used", "use_unsloth_gc"),
    **_noted("hp runs the model's own HF modules, laid out by the strategy; fused kernel replacements are not applied",
             "enable_liger_kernel", "use_liger_kernel", "liger_kernel_config", "use_v1_kernels"),
    **_noted("no model hp trains has a mixture-of-experts router (MoE models are not available yet)",
             "moe_aux_loss_coef"),
    **_noted("hp's recompute always runs non-reentrant torch.utils.checkpoint", "use_reentrant_gc"),
    **_noted("weights are kept in fp32 anyway (bf16: true computes under autocast)", "upcast_layernorm"),
    **_noted("the loss is computed from fp32 logits anyway (HF's causal-LM loss upcasts them)",
             "upcast_lmhead_output"),
    **_refused("the weights are read from model_name_or_path (hp/tiny-llama alone starts from seeded random weights)",
               {"train_from_scratch": False}),
    **_noted("a setting of inference (llamafactory-cli chat, api, webchat), which hp train does not run",
             "infer_backend", "use_kv_cache", "infer_dtype", "offload_folder"),
    **_noted("the parameters' status is not printed (hp explain shows a model's layout)", "print_param_status"),
    **_refused(_QUANTIZED, {"quantization_bit": None, "quantization_method": "bnb", "quantization_type": "nf4",
                            "double_quantization": True, "quantization_device_map": None}),
    **_refused(_MULTIMODAL, {"image_min_pixels": 32 * 32, "image_do_pan_and_scan": False, "crop_to_patches": False,
                             "media_dir": None}),
    **_noted("hp train reads no video or audio: a dataset mapping a videos or audios column is refused",
             "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
             "audio_sampling_rate"),
    **_noted("a setting of llamafactory-cli export; hp export CHECKPOINT DIR writes an HF model directory",
             "export_dir", "export_size", "export_device", "export_quantization_bit", "export_quantization_dataset",
             "export_quantization_nsamples", "export_quantization_maxlen", "export_legacy_format",
             "export_hub_model_id"),
    **_refused(_KTRANSFORMERS, {
        "use_kt": False, "kt_cpu_activation": None, "kt_weight_path": None, "kt_non_expert_weight_path": None,
        "kt_expert_checkpoint_path": None, "kt_use_lora_experts": None, "kt_lora_expert_num": None,
        "kt_lora_expert_intermediate_size": None, "kt_config": None}),
    **_noted("a setting of the vLLM inference engine, which hp train does not run",
             "vllm_maxlen", "vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config"),
    **_noted("a setting of the SGLang inference engine, which hp train does not run",
             "sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config", "sglang_lora_backend"),
    # ------------------------------------------------ data
    **_refused("datasets are read whole from local files; streaming is not available",
               {"streaming": False, "buffer_size": 16384}),
    **_refused("datasets are concatenated in the order named; interleaving them is not available",
               {"mix_strategy": "concat", "interleave_probs": None}),
    **_noted("hp train keeps no cache of tokenized data: it tokenizes at every start", "overwrite_cache"),
    **_noted("hp train does not tokenize through HF datasets' map, so there are no groups of examples to size",
             "preprocessing_batch_size"),
    **_refused("tokenized datasets are neither saved nor loaded: the data is tokenized at every start",
               {"tokenized_path": None}),
    **_noted("every rank reads and tokenizes the data itself", "data_shared_file_system"),
    **_refused("padding never carries loss here: its labels are always -100", {"ignore_pad_token_for_loss": True}),
    **_noted("evaluation reports one eval_loss over all of eval_dataset", "eval_on_each_dataset"),
    "packing": ForeignKey("hp packs pt documents into cutoff_len blocks and never packs sft examples (each is padded "
                          "to its batch's longest)", True, (None,), (("pt", (True,)), ("sft", (False,)))),
    **_refused("sft examples are never packed here (each is padded to its batch's longest)", {"neat_packing": False}),
    **_refused("tool formats are not available yet: a dataset's tools column is read and ignored, and a function "
               "call is encoded as a plain answer", {"tool_format": None}),
    # ------------------------------------------------ finetuning: methods, losses, optimizers
    **_refused("LLaMA Pro block expansion (a freeze or LoRA method) is not available yet", {"use_llama_pro": False}),
    **_refused(_ADAPTERS, {
        "adapter_name_or_path": None, "adapter_folder": None, "create_new_adapter": False, "loraplus_lr_ratio": None,
        "loraplus_lr_embedding": 1e-6, "use_dora": False, "pissa_init": False, "pissa_iter": 16,
        "pissa_convert": False, "oft_rank": 0, "oft_block_size": 32, "oft_target": "all", "module_dropout": 0.0}),
    **_refused(_PREFERENCE, {
        "pref_bco_weight": 0.0, "ld_alpha": None,
        "ppo_buffer_size": 1, "ppo_epochs": 4, "ppo_score_norm": False, "ppo_target": 6.0, "ppo_whiten_rewards": False,
        "ref_model_adapters": None, "ref_model_quantization_bit": None, "reward_model": None,
        "reward_model_adapters": None, "reward_model_quantization_bit": None, "reward_model_type": "lora"}),
    **_optimizer("GaLore", {"use_galore": False, "galore_target": "all", "galore_rank": 16,
                            "galore_update_interval": 200, "galore_scale": 2.0, "galore_proj_type": "std",
                            "galore_layerwise": False, "optim_target_modules": None}),
    **_optimizer("APOLLO", {"use_apollo": False, "apollo_target": "all", "apollo_rank": 16,
                            "apollo_update_interval": 200, "apollo_scale": 32.0, "apollo_proj": "random",
                            "apollo_proj_type": "std", "apollo_scale_type": "channel", "apollo_layerwise": False,
                            "apollo_scale_front": False}),
    **_optimizer("BAdam", {"use_badam": False, "badam_mode": "layer", "badam_start_block": None,
                           "badam_switch_mode": "ascending", "badam_switch_interval": 50, "badam_update_ratio": 0.05,
                           "badam_mask_mode": "adjacent", "badam_verbose": 0}),
    **_optimizer("Adam-mini", {"use_adam_mini": False}),
    **_optimizer("Muon", {"use_muon": False}),
    **_optimizer("Adafactor", {"adafactor": False}),
    **_refused("hp train's optimizer is torch's AdamW", {"optim": "adamw_torch", "optim_args": None},
               also={"optim": ("adamw_torch_fused",)}),
    **_refused("AdamW runs with torch's defaults: betas (0.9, 0.999), eps 1e-8",
               {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}),
    **_noted(f"SwanLab is not written to; {_TRACKERS}", "use_swanlab", "swanlab_project", "swanlab_workspace",
             "swanlab_run_name", "swanlab_mode", "swanlab_logdir",
             secrets=("swanlab_api_key", "swanlab_lark_webhook_url", "swanlab_lark_secret")),
    **_refused("weights stay in fp32 and bf16: true computes under autocast; pure bf16 training is not available",
               {"pure_bf16": False}),
    **_noted("LlamaFactory sets it from its USE_MCA and USE_MEGATRON_BRIDGE environment variables; hp train lays "
             "the model out by its parallel: section", "use_mca", "use_megatron_bridge"),
    **_refused(_LOSS, {"use_dft_loss": False, "use_asft_loss": False, "asft_alpha": 0.1, "use_eaft_loss": False,
                       "eaft_alpha": 1.0}),
    **_noted("evaluation reports eval_loss and eval_perplexity only", "compute_accuracy"),
    **_refused("the training examples are always drawn in a seeded random order", {"disable_shuffling": False}),
    **_refused("early stopping is not available: training runs max_steps or num_train_epochs",
               {"early_stopping_steps": None}),
    **_noted("the summary reports tokens_per_s over every processed token, padding included",
             "include_effective_tokens_per_second", "include_tokens_per_second", "include_num_input_tokens_seen"),
    # ------------------------------------------------ generation (LlamaFactory's GeneratingArguments and HF's)
    **_noted(_GENERATION, "do_sample", "temperature", "top_p", "top_k", "num_beams", "max_new_tokens",
             "repetition_penalty", "length_penalty", "skip_special_tokens", "eval_num_beams",
             "generation_max_length", "generation_num_beams", "generation_config"),
    **_noted(f"{_GENERATION}; the training sequence length is cutoff_len", "max_length"),
    **_refused("prediction is not available yet: hp train trains, and evaluates the loss", {"do_predict": False}),
    **_refused("evaluation computes the loss; generating predictions is not available yet",
               {"predict_with_generate": False}),
    **_refused("sortish sampling (for generation) is not available: evaluation batches follow the data's order",
               {"sortish_sampler": False}),
    # ------------------------------------------------ HF Trainer: schedule, precision, loss
    **_refused("the schedule is set by lr_scheduler_type and warmup_ratio alone", {"lr_scheduler_kwargs": None},
               also={"lr_scheduler_kwargs": ({},)}),
    **_refused("warmup is warmup_ratio here (a fraction of the steps)", {"warmup_steps": 0}),
    **_noted("the loss is the mean over the global batch's supervised tokens on every rank (the strategy lays the "
             "batch out), whatever this key says", "average_tokens_across_devices"),
    **_refused("label smoothing is not available: the loss is plain cross-entropy", {"label_smoothing_factor": 0.0}),
    **_refused("only bf16 mixed precision is available: bf16: true", {"fp16": False}),
    **_refused("evaluation runs as training does: fp32 weights, under bf16 autocast when bf16: true",
               {"bf16_full_eval": False, "fp16_full_eval": False}),
    **_noted("a setting of fp16 training, which hp train does not run", "fp16_opt_level", "half_precision_backend",
             "fp16_backend"),
    **_refused("TF32 matmuls are not switched on: fp32 matmuls stay full precision (PyTorch's default)",
               {"tf32": None}, also={"tf32": (False,)}),
    **_noted("activations are recomputed per decoder block unless disable_gradient_checkpointing: true (LlamaFactory's "
             "switch) or the parallel: section says otherwise; HF's own switch is not read",
             "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
             "activation_checkpointing_kwargs"),
    **_noted("torch_compile compiles each decoder block and the loss with inductor's defaults (parallel.compile)",
             "torch_compile_backend", "torch_compile_mode", "torchdynamo", "jit_mode_eval"),
    **_noted("the model's KV cache is always off in training", "use_cache"),
    **_refused("NEFTune's embedding noise is not available", {"neftune_noise_alpha": None}),
    **_noted("hp train leaves the allocator's cache alone", "torch_empty_cache_steps"),
    **_refused("the batch size is per_device_train_batch_size, as given", {"auto_find_batch_size": False}),
    **_refused("the batch size is per_device_train_batch_size (per_gpu_* are HF's old names)",
               {"per_gpu_train_batch_size": None, "per_gpu_eval_batch_size": None}),
    **_refused("feeding a model's past states back as input (past_index) is not available", {"past_index": -1}),
    # ------------------------------------------------ HF Trainer: logging and trackers
    **_noted(f"rank 0 logs every logging_steps steps and step 1; {_TRACKERS}", "logging_strategy",
             "logging_first_step", "log_on_each_node", "log_level_replica"),
    **_noted("a loss or gradient norm that is not finite stops the run", "logging_nan_inf_filter"),
    **_noted("hp train prints its own progress and one message per failure (hp train --debug shows everything)",
             "log_level"),
    **_noted("rank 0 always shows its progress bar", "disable_tqdm"),
    **_noted(f"runs are named by output_dir; {_TRACKERS}", "run_name", "project", "trackio_space_id",
             "trackio_bucket_id", "trackio_static_space_id"),
    **_noted("the summary always reports peak_memory_bytes", "skip_memory_metrics"),
    **_noted("HF Trainer's debug switches are not read (hp train --debug shows every log)", "debug"),
    # ------------------------------------------------ HF Trainer: evaluation
    **_noted("evaluation runs as eval_strategy and eval_steps say (do_eval: true alone: once, at the end)",
             "eval_delay", "eval_on_start"),
    **_noted("evaluation computes the loss per supervised token only, over all its batches at once",
             "prediction_loss_only", "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object",
             "include_for_metrics", "include_inputs_for_metrics", "batch_eval_metrics", "use_legacy_prediction_loop",
             "label_names"),
    # ------------------------------------------------ HF Trainer: checkpoints and the hub
    **_refused("a checkpoint is written every save_steps steps and at the end", {"save_strategy": "steps"}),
    **_refused("all ranks write one checkpoint together in output_dir (on a filesystem every node shares)",
               {"save_on_each_node": False}),
    **_noted("checkpoints are written every save_steps steps and at the end, never on a signal",
             "enable_jit_checkpoint"),
    **_noted("checkpoints are torch.distributed.checkpoint files; hp export writes safetensors", "save_safetensors"),
    **_refused(_HUB, {"push_to_hub": False}),
    **_noted(f"only read with push_to_hub; {_HUB}", "hub_model_id", "hub_strategy", "hub_private_repo",
             "hub_always_push", "hub_revision", "push_to_hub_model_id", "push_to_hub_organization",
             secrets=("hub_token", "push_to_hub_token")),
    **_refused("the last checkpoint is the model; keeping the best one is not available",
               {"load_best_model_at_end": False}),
    **_noted("only read with load_best_model_at_end or early_stopping_steps, which hp train does not take",
             "metric_for_best_model", "greater_is_better"),
    **_refused("a resumed run continues the data exactly where its checkpoint left it",
               {"ignore_data_skip": False}),
    **_noted("there are no callbacks: the trainer's state is restored whole",
             "restore_callback_states_from_checkpoint"),
    # ------------------------------------------------ HF Trainer: seeds, devices, data loading, distribution
    **_refused("seed makes the data order and initial weights reproducible, but PyTorch's deterministic algorithms "
               "are not switched on", {"full_determinism": False}),
    **_refused("the data order follows seed", {"data_seed": None}),
    **_refused("the device is chosen with device: auto, cpu, cuda or npu (write device: cpu)",
               {"use_cpu": False, "no_cuda": False}),
    **_refused("hp train runs on cpu, cuda or npu devices", {"use_mps_device": False}),
    **_noted("a TPU setting; hp train runs on cpu, cuda or npu devices", "tpu_num_cores", "tpu_metrics_debug"),
    **_refused("hp train does not run HF Accelerate: every rank draws the same global batch and the strategy lays "
               "it out", {"accelerator_config": None}),
    **_refused("parallelism is hp's parallel: section", {"parallelism_config": None}),
    **_noted("every batch is full: the examples that do not fill a last one wait for a later epoch's order",
             "dataloader_drop_last"),
    **_noted(_LOADER, "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
             "dataloader_multiprocessing_context"),
    **_noted("batches are always handed to the step in their order", "dataloader_in_order"),
    **_noted("the tokenized examples hold input_ids and labels only", "remove_unused_columns", "length_column_name"),
    **_refused("the training examples are drawn in a seeded random order", {"train_sampling_strategy": "random",
                                                                            "group_by_length": False}),
    **_noted("there is no DistributedDataParallel: gradients are reduced by the strategy, over the process group "
             "of the device's backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
             "ddp_static_graph", "ddp_backend"),
    **_noted("hp's FSDP wraps every decoder block of the model plan, whatever its size", "fsdp_min_num_params"),
    **_noted("hp train's launcher gives each worker its rank", "local_rank"),
    **_noted("a setting of SageMaker model parallel or of HF's hyperparameter search, which hp train does not run",
             "mp_parameters", "ray_scope"),
    # ------------------------------------------------ LlamaFactory's Ray, FP8 and profiler keys
    **_refused("Ray is not available: hp train starts its workers itself (nproc_per_node, nnodes)",
               {"ray_num_workers": 1, "ray_init_kwargs": None, "ray_run_name": None, "ray_storage_path": None,
                "ray_storage_filesystem": None, "resources_per_worker": None, "placement_strategy": None}),
    **_refused(_FP8, {"fp8": False, "fp8_backend": "auto", "fp8_enable_fsdp_float8_all_gather": False}),
    **_noted("no profiler traces are written (benchmarks/llama_step.py times a step; hp.comm.trace counts its "
             "collectives)", "enable_torch_profiler", "profiler_output_dir", "profiler_wait_steps",
             "profiler_warmup_steps", "profiler_active_steps", "profiler_repeat", "profiler_record_shapes",
             "profiler_profile_memory", "profiler_with_stack", "profile_modules"),
    # ------------------------------------------------ Megatron-Core keys (LlamaFactory's USE_MCA and Megatron Bridge)
    **_refused(f"{_MEGATRON}: tensor parallel is parallel.tp", {"tensor_model_parallel_size": 1}),
    **_refused(f"{_MEGATRON}: context parallel is parallel.cp", {"context_parallel_size": 1}),
    **_refused(f"{_MEGATRON}: sequence parallel is parallel.sp", {"sequence_parallel": False}),
    **_refused(f"{_MEGATRON}: pipeline parallel is not available", {"pipeline_model_parallel_size": 1,
                                                                    "virtual_pipeline_model_parallel_size": None,
                                                                    "account_for_embedding_in_pipeline_split": None,
                                                                    "account_for_loss_in_pipeline_split": None}),
    **_refused(f"{_MEGATRON}: expert parallel is not available yet", {"expert_model_parallel_size": 1,
                                                                      "moe_token_dispatcher_type": None}),
    **_refused(f"{_MEGATRON}: activations are recomputed per decoder block (disable_gradient_checkpointing, "
               "parallel.recompute)", {"recompute_granularity": None, "recompute_method": None,
                                       "recompute_num_layers": None}),
    **_refused("precision is bf16: true here (Megatron's and Accelerate's mixed_precision are not read)",
               {"mixed_precision": "bf16_mixed"}),
    **_refused(f"{_MEGATRON}: its checkpoints are not read", {"megatron_pretrained_checkpoint": None,
                                                              "extra_config": None}),
    **_refused(f"{_MEGATRON}: sft examples are never packed here", {"use_packed_sequences": False}),
    **_refused(f"{_MEGATRON}: the loss is the mean over the supervised tokens", {"calculate_per_token_loss": None}),
    **_noted(f"{_MEGATRON}; its fusions and overlap switches change speed, not results", "bias_activation_fusion",
             "apply_rope_fusion", "masked_softmax_fusion", "cross_entropy_loss_fusion", "moe_grouped_gemm",
             "use_distributed_optimizer", "overlap_param_gather", "overlap_grad_reduce"),
    **_noted(f"{_MEGATRON}; hp export CHECKPOINT DIR writes an HF model directory", "export_hf_on_finish"),
    # ------------------------------------------------ LlamaFactory v1's config format
    **_pointers(_V1, {
        "model": "write model_name_or_path", "model_class": "hp picks the model's plan by its config's model_type",
        "custom_chat_template": "write template", "init_config": "every rank reads its own blocks of the weights",
        "peft_config": _ADAPTERS, "kernel_config": "hp runs the model's own HF modules",
        "quant_config": _QUANTIZED, "sample_backend": _GENERATION, "train_dataset": "write dataset and dataset_dir",
        "micro_batch_size": "write per_device_train_batch_size",
        "global_batch_size": "write per_device_train_batch_size and gradient_accumulation_steps",
        "batching_strategy": "sft examples are padded to their batch's longest, never packed",
        "batching_workers": "write dataloader_num_workers",
        "enable_activation_checkpointing": "write disable_gradient_checkpointing or parallel.recompute",
        "dist_config": "write the parallel: section", "dp_size": "write parallel.dp", "cp_size": "write parallel.cp",
        "cp_mode": "write parallel.cp_algorithm", "mp_replicate_size": "write the parallel: section",
        "mp_shard_size": "write parallel.dp with parallel.fsdp: true", "dist_timeout": "write ddp_timeout",
        "optim_config": "hp train's optimizer is torch's AdamW (learning_rate, weight_decay)",
        "lr_scheduler_config": "write lr_scheduler_type and warmup_ratio",
        "save_epochs": "write save_steps", "save_ckpt_as_hf": "hp export CHECKPOINT DIR writes an HF model directory",
    }),
    # ------------------------------------------------ Accelerate launch configs (examples/accelerate)
    **{key: ForeignKey(_ACCELERATE, True) for key in (
        "compute_environment", "distributed_type", "downcast_bf16", "machine_rank", "main_process_ip",
        "main_process_port", "main_training_function", "num_machines", "num_processes", "rdzv_backend",
        "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo")},
}

FOREIGN_KEYS: Mapping[str, ForeignKey] = MappingProxyType(_TABLE)


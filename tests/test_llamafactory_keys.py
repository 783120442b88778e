"""The table of LlamaFactory keys hp train takes no setting from (hp.train.config.llamafactory_keys), against the real lists.

Every key of LlamaFactory's argument sets and of HF's Seq2SeqTrainingArguments
must be a TrainConfig field, a key the config reads itself, or in the table;
a key given at its default must never fail a config; and through `validate`,
a refusal names the key and the reason, every refused key is listed at once,
and an accepted key is kept with its note.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from hp.train.config import ConfigError, TrainConfig, to_dict, validate
from hp.train.config.llamafactory_keys import FOREIGN_KEYS, HIDDEN, verdict

MINIMAL = {"model_name_or_path": "hp/tiny-llama", "dataset": "alpaca_en_demo", "output_dir": "saves/tiny"}
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"no_effect", "notes"}
# Keys the config module reads and maps itself, beside TrainConfig's fields (sharding, trackers, templates).
BY_THE_CONFIG = {
    "deepspeed", "fsdp", "fsdp_config", "fsdp_transformer_layer_cls_to_wrap", "hyper_parallel_cp_size", "report_to",
    "dataloader_num_workers", "preprocessing_num_workers", "template",
}

# LlamaFactory's keys and their defaults beside HF's, as its hparams define them (hiyouga/LLaMA-Factory at
# ff6d4d12, which takes transformers 4.55 to 5.8); HF's own come from the installed transformers.
LLAMAFACTORY_DEFAULTS = {
    # ModelArguments (with its quantization, processor, export, KTransformers, vLLM, SGLang bases)
    'model_name_or_path': None, 'adapter_name_or_path': None, 'adapter_folder': None, 'cache_dir': None,
    'use_fast_tokenizer': True, 'resize_vocab': False, 'split_special_tokens': False, 'add_tokens': None,
    'add_special_tokens': None, 'new_special_tokens_config': None, 'init_special_tokens': 'noise_init',
    'model_revision': 'main', 'low_cpu_mem_usage': True, 'rope_scaling': None, 'flash_attn': 'auto',
    'shift_attn': False, 'mixture_of_depths': None, 'use_unsloth': False, 'use_unsloth_gc': False,
    'enable_liger_kernel': False, 'moe_aux_loss_coef': None, 'disable_gradient_checkpointing': False,
    'use_reentrant_gc': True, 'upcast_layernorm': False, 'upcast_lmhead_output': False, 'train_from_scratch': False,
    'infer_backend': 'huggingface', 'offload_folder': 'offload', 'use_kv_cache': True, 'use_v1_kernels': False,
    'infer_dtype': 'auto', 'hf_hub_token': None, 'ms_hub_token': None, 'om_hub_token': None,
    'print_param_status': False, 'trust_remote_code': False, 'quantization_method': 'bnb', 'quantization_bit': None,
    'quantization_type': 'nf4', 'double_quantization': True, 'quantization_device_map': None,
    'image_max_pixels': 589824, 'image_min_pixels': 1024, 'image_do_pan_and_scan': False, 'crop_to_patches': False,
    'video_max_pixels': 65536, 'video_min_pixels': 256, 'video_fps': 2.0, 'video_maxlen': 128,
    'use_audio_in_video': False, 'audio_sampling_rate': 16000, 'export_dir': None, 'export_size': 5,
    'export_device': 'cpu', 'export_quantization_bit': None, 'export_quantization_dataset': None,
    'export_quantization_nsamples': 128, 'export_quantization_maxlen': 1024, 'export_legacy_format': False,
    'export_hub_model_id': None, 'use_kt': False, 'kt_cpu_activation': None, 'kt_weight_path': None,
    'kt_non_expert_weight_path': None, 'kt_expert_checkpoint_path': None, 'kt_use_lora_experts': None,
    'kt_lora_expert_num': None, 'kt_lora_expert_intermediate_size': None, 'vllm_maxlen': 4096, 'vllm_gpu_util': 0.7,
    'vllm_enforce_eager': False, 'vllm_max_lora_rank': 32, 'vllm_config': None, 'sglang_maxlen': 4096,
    'sglang_mem_fraction': 0.7, 'sglang_tp_size': -1, 'sglang_config': None, 'sglang_lora_backend': 'triton',
    # DataArguments
    'template': None, 'dataset': None, 'eval_dataset': None, 'dataset_dir': 'data', 'media_dir': None,
    'cutoff_len': 2048, 'train_on_prompt': False, 'mask_history': False, 'streaming': False, 'buffer_size': 16384,
    'mix_strategy': 'concat', 'interleave_probs': None, 'overwrite_cache': False, 'preprocessing_batch_size': 1000,
    'preprocessing_num_workers': None, 'max_samples': None, 'eval_num_beams': None,
    'ignore_pad_token_for_loss': True, 'val_size': 0.0, 'eval_on_each_dataset': False, 'packing': None,
    'neat_packing': False, 'tool_format': None, 'default_system': None, 'enable_thinking': True,
    'preserve_thinking': False, 'tokenized_path': None, 'data_shared_file_system': False,
    # FinetuningArguments (freeze, LoRA, OFT, RLHF, GaLore, APOLLO, BAdam, SwanLab bases)
    'freeze_trainable_layers': 2, 'freeze_trainable_modules': 'all', 'freeze_extra_modules': None,
    'additional_target': None, 'module_dropout': 0.0, 'oft_rank': 0, 'oft_block_size': 32, 'oft_target': 'all',
    'create_new_adapter': False, 'lora_alpha': None, 'lora_dropout': 0.0, 'lora_rank': 8, 'lora_target': 'all',
    'loraplus_lr_ratio': None, 'loraplus_lr_embedding': 1e-06, 'use_rslora': False, 'use_dora': False,
    'pissa_init': False, 'pissa_iter': 16, 'pissa_convert': False, 'pref_beta': 0.1, 'pref_ftx': 0.0,
    'pref_bco_weight': 0.0, 'pref_loss': 'sigmoid', 'dpo_label_smoothing': 0.0, 'kto_chosen_weight': 1.0,
    'kto_rejected_weight': 1.0, 'simpo_gamma': 0.5, 'ppo_buffer_size': 1, 'ppo_epochs': 4, 'ppo_score_norm': False,
    'ppo_target': 6.0, 'ppo_whiten_rewards': False, 'ref_model': None, 'ref_model_adapters': None,
    'ref_model_quantization_bit': None, 'reward_model': None, 'reward_model_adapters': None,
    'reward_model_quantization_bit': None, 'reward_model_type': 'lora', 'ld_alpha': None, 'use_galore': False,
    'galore_target': 'all', 'galore_rank': 16, 'galore_update_interval': 200, 'galore_scale': 2.0,
    'galore_proj_type': 'std', 'galore_layerwise': False, 'use_apollo': False, 'apollo_target': 'all',
    'apollo_rank': 16, 'apollo_update_interval': 200, 'apollo_scale': 32.0, 'apollo_proj': 'random',
    'apollo_proj_type': 'std', 'apollo_scale_type': 'channel', 'apollo_layerwise': False,
    'apollo_scale_front': False, 'use_badam': False, 'badam_mode': 'layer', 'badam_start_block': None,
    'badam_switch_mode': 'ascending', 'badam_switch_interval': 50, 'badam_update_ratio': 0.05,
    'badam_mask_mode': 'adjacent', 'badam_verbose': 0, 'use_swanlab': False, 'swanlab_project': 'llamafactory',
    'swanlab_workspace': None, 'swanlab_run_name': None, 'swanlab_mode': 'cloud', 'swanlab_api_key': None,
    'swanlab_logdir': None, 'swanlab_lark_webhook_url': None, 'swanlab_lark_secret': None, 'pure_bf16': False,
    'stage': 'sft', 'finetuning_type': 'lora', 'use_llama_pro': False, 'use_adam_mini': False, 'use_mca': False,
    'use_megatron_bridge': False, 'use_hyper_parallel': False, 'hyper_parallel_args': None,
    'hyper_parallel_cp_size': 1, 'use_muon': False, 'use_dft_loss': False, 'use_asft_loss': False, 'asft_alpha': 0.1,
    'use_eaft_loss': False, 'eaft_alpha': 1.0, 'freeze_vision_tower': True, 'freeze_multi_modal_projector': True,
    'freeze_language_model': False, 'compute_accuracy': False, 'disable_shuffling': False,
    'early_stopping_steps': None, 'plot_loss': False, 'include_effective_tokens_per_second': False,
    # GeneratingArguments
    'do_sample': True, 'temperature': 0.95, 'top_p': 0.7, 'top_k': 50, 'num_beams': 1, 'max_length': 1024,
    'max_new_tokens': 1024, 'repetition_penalty': 1.0, 'length_penalty': 1.0, 'skip_special_tokens': True,
    # TrainingArguments' own keys (Ray, FP8, profiler) over HF's Seq2SeqTrainingArguments
    'ray_num_workers': 1, 'ray_init_kwargs': None, 'master_addr': None, 'master_port': None, 'fp8': False,
    'fp8_backend': 'auto', 'fp8_enable_fsdp_float8_all_gather': False, 'enable_torch_profiler': False,
    'profiler_output_dir': None, 'profiler_wait_steps': 1, 'profiler_warmup_steps': 1, 'profiler_active_steps': 1,
    'profiler_repeat': 1, 'profiler_record_shapes': True, 'profiler_profile_memory': True,
    'profiler_with_stack': True, 'profile_modules': None, 'overwrite_output_dir': False,
    # MegatronBridgeArguments (read with USE_MEGATRON_BRIDGE=1)
    'tensor_model_parallel_size': 1, 'pipeline_model_parallel_size': 1, 'expert_model_parallel_size': 1,
    'context_parallel_size': 1, 'virtual_pipeline_model_parallel_size': None, 'sequence_parallel': False,
    'recompute_granularity': None, 'recompute_method': None, 'recompute_num_layers': None,
    'account_for_embedding_in_pipeline_split': None, 'account_for_loss_in_pipeline_split': None,
    'bias_activation_fusion': None, 'apply_rope_fusion': None, 'masked_softmax_fusion': None,
    'cross_entropy_loss_fusion': None, 'moe_grouped_gemm': None, 'moe_token_dispatcher_type': None,
    'calculate_per_token_loss': None, 'use_distributed_optimizer': True, 'overlap_param_gather': True,
    'overlap_grad_reduce': True, 'use_packed_sequences': False, 'mixed_precision': 'bf16_mixed',
    'megatron_pretrained_checkpoint': None, 'export_hf_on_finish': False, 'extra_config': None,
    # HF TrainingArguments keys of transformers 4.55-4.57 that the installed 5.x no longer has
    'per_gpu_train_batch_size': None, 'per_gpu_eval_batch_size': None,
    'warmup_ratio': 0.0, 'logging_dir': None, 'save_safetensors': True, 'no_cuda': False, 'use_mps_device': False,
    'jit_mode_eval': False, 'fp16_opt_level': 'O1', 'half_precision_backend': 'auto', 'tpu_num_cores': None,
    'tpu_metrics_debug': False, 'past_index': -1, 'fsdp_min_num_params': 0,
    'fsdp_transformer_layer_cls_to_wrap': None, 'adafactor': False, 'group_by_length': False,
    'use_legacy_prediction_loop': False, 'include_inputs_for_metrics': False, 'fp16_backend': 'auto',
    'push_to_hub_model_id': None, 'push_to_hub_organization': None, 'push_to_hub_token': None, 'mp_parameters': '',
    'torchdynamo': None, 'ray_scope': 'last', 'include_tokens_per_second': False,
}
# Keys of LlamaFactory's example configs outside those sets: its v1 format, and its Accelerate launch files.
EXAMPLE_KEYS = (
    "model", "model_class", "peft_config", "kernel_config", "dist_config", "init_config", "train_dataset",
    "micro_batch_size", "sample_backend", "quant_config", "optim_config", "cp_size", "cp_mode", "batching_strategy",
    "kt_config", "compute_environment", "distributed_type", "downcast_bf16", "machine_rank", "main_process_ip",
    "main_process_port", "main_training_function", "num_machines", "num_processes", "rdzv_backend", "same_network",
    "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "mixed_precision", "debug", "use_cpu",
)


def _hf_defaults() -> dict:
    from transformers import Seq2SeqTrainingArguments

    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init}


def test_every_key_of_hf_and_llamafactory_has_an_answer():
    keys = {**_hf_defaults(), **LLAMAFACTORY_DEFAULTS}.keys() | set(EXAMPLE_KEYS)
    assert sorted(keys - FIELDS - BY_THE_CONFIG - FOREIGN_KEYS.keys()) == []


def test_the_table_holds_no_key_the_config_takes():
    assert FIELDS & FOREIGN_KEYS.keys() == set()
    assert BY_THE_CONFIG & FOREIGN_KEYS.keys() == set()


@pytest.mark.parametrize("stage", ["pt", "sft"])
def test_a_key_at_its_default_never_fails(stage):
    defaults = {**_hf_defaults(), **LLAMAFACTORY_DEFAULTS}
    refused = {key: verdict(key, value, stage).message for key, value in defaults.items()
               if key in FOREIGN_KEYS and not verdict(key, value, stage).accepted}
    assert refused == {}


def test_the_table_is_read_only_and_each_reason_one_line():
    assert isinstance(FOREIGN_KEYS, MappingProxyType)
    for key, entry in FOREIGN_KEYS.items():
        assert entry.reason and "\n" not in entry.reason and not entry.reason.endswith("."), key
        assert not (entry.harmless or entry.harmless_in) or entry.refused, key  # harmless values: refused keys only


def test_a_refusal_names_the_key_the_value_the_reason_and_the_harmless_values():
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "fp16": True})
    assert str(err.value) == ("fp16 = True is not taken by hp train (only bf16 mixed precision is available: bf16: "
                              "true); expected no fp16 key, or a value that changes nothing here: false")


def test_every_refused_key_is_listed_at_once_with_the_other_problems():
    raw = {**MINIMAL, "use_dora": True, "use_galore": True, "optim": "sgd", "neftune_noise_alpha": 5,
           "learnig_rate": 1e-4, "cache_dir": "/data/hf"}
    with pytest.raises(ConfigError) as err:
        validate(raw)
    lines = str(err.value).splitlines()
    assert lines[0] == "5 problems in the config:"
    assert [line.split(" = ")[0] for line in lines[1:]] == [
        "  - use_dora", "  - use_galore", "  - optim", "  - neftune_noise_alpha", "  - unknown key 'learnig_rate'"]
    assert "(GaLore is not available: hp train's optimizer is torch's AdamW)" in lines[2]
    assert "expected no optim key, or a value that changes nothing here: adamw_torch, adamw_torch_fused" in lines[3]


def test_harmless_values_pass_silently_and_notes_are_kept():
    raw = {**MINIMAL, "fp16": False, "optim": "adamw_torch_fused", "adam_epsilon": "1e-8", "use_dora": False,
           "flash_attn": "fa2", "use_reentrant_gc": False, "hf_hub_token": "hf_secret", "packing": False}
    cfg = validate(raw)
    assert dict(cfg.no_effect) == {"fp16": False, "optim": "adamw_torch_fused", "adam_epsilon": "1e-8",
                                   "use_dora": False, "flash_attn": "fa2", "use_reentrant_gc": False,
                                   "hf_hub_token": HIDDEN, "packing": False}
    notes = {key: verdict(key, value, cfg.stage).message for key, value in cfg.no_effect.items()}
    assert [key for key, note in notes.items() if note] == ["flash_attn", "use_reentrant_gc", "hf_hub_token"]
    assert notes["flash_attn"].startswith("flash_attn = 'fa2' has no effect here (attention follows the model's")
    assert "hf_secret" not in notes["hf_hub_token"] and "hf_secret" not in str(to_dict(cfg))
    assert validate(to_dict(cfg)) == cfg


def test_packing_is_harmless_as_hp_does_it_in_each_stage():
    assert validate({**MINIMAL, "stage": "pt", "packing": True}).no_effect["packing"] is True
    validate({**MINIMAL, "stage": "sft", "packing": False})
    for stage, packing in (("pt", False), ("sft", True)):
        with pytest.raises(ConfigError, match=f"packing = {packing} is not taken by hp train .hp packs pt documents"):
            validate({**MINIMAL, "stage": stage, "packing": packing})


def test_keys_the_table_lacks_are_left_to_the_config():
    assert verdict("learning_rate", 1e-4) is None and verdict("no_such_key", 1) is None
    with pytest.raises(ConfigError, match="unknown key 'no_such_key' = 1"):
        validate({**MINIMAL, "no_such_key": 1})

"""`hp export CHECKPOINT OUT_DIR [--merge]`: a training checkpoint as a HF model directory, or a PEFT adapter.

The checkpoint's sharded weights (any strategy) are gathered into the
unsharded model that its `config.json` describes and written with
`save_pretrained`, so `transformers` loads them and gives the run's logits.
A LoRA run's checkpoint (it holds PEFT's `adapter_config.json`) is written
as PEFT writes an adapter: `adapter_config.json` and
`adapter_model.safetensors`, the adapters and the modules trained in full,
so `peft.PeftModel.from_pretrained(base, OUT_DIR)` loads it; with `--merge`
the adapters are folded into their base weights and the directory is a
plain HF model. The tokenizer files the checkpoint carries go along, so the
directory is complete: `hp train` continues from a full one
(`model_name_or_path: OUT_DIR`). A reward model's value head (stage rm) is
written apart, as LlamaFactory writes it: `value_head.safetensors` with
`v_head.summary.weight` and `v_head.summary.bias`, beside the language model
(or its adapter) that transformers and PEFT load as usual.
"""

from __future__ import annotations

import json
import os
import shutil

from hp.train import checkpoint

VALUE_HEAD_FILE = "value_head.safetensors"  # LlamaFactory's (and TRL's) name for a reward model's head
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja")


def export(checkpoint_dir: str, out_dir: str, *, merge: bool = False) -> str:
    """Write `checkpoint_dir`'s model (or adapter) and tokenizer to `out_dir`; returns `out_dir`.

    >>> export("/nonexistent", "/tmp/x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    hp.train.checkpoint.CheckpointError: ...
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from hp.parallel.lora import add_lora, from_peft_config, merge_lora, peft_state
    from hp.train.model import VALUE_HEAD, add_value_head, model_class

    checkpoint.require_complete(checkpoint_dir)
    config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    model = model_class(config).from_config(config)
    adapter = _adapter_config(checkpoint_dir)
    if adapter is not None:
        add_lora(model, from_peft_config(adapter))
    head = checkpoint.holds(checkpoint_dir, f"{VALUE_HEAD}.weight")
    if head:
        add_value_head(model, seed=0)  # its values are the checkpoint's
    checkpoint.load_model_weights(checkpoint_dir, model)
    os.makedirs(out_dir, exist_ok=True)
    if head:
        v_head = model.get_submodule(VALUE_HEAD)
        save_file({f"{VALUE_HEAD}.summary.{name}": p.detach().contiguous() for name, p in v_head.named_parameters()},
                  os.path.join(out_dir, VALUE_HEAD_FILE), metadata={"format": "pt"})
        delattr(model, VALUE_HEAD)
    if adapter is not None and not merge:
        save_file(peft_state(model), os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out_dir, checkpoint.ADAPTER_CONFIG), "w") as f:
            json.dump(adapter, f, indent=2)
    else:
        if adapter is not None:
            merge_lora(model)
        model.save_pretrained(out_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(checkpoint_dir, name)):
            shutil.copy(os.path.join(checkpoint_dir, name), out_dir)
    return out_dir


def _adapter_config(checkpoint_dir: str) -> dict | None:
    path = os.path.join(checkpoint_dir, checkpoint.ADAPTER_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)

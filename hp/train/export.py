"""`hp export CHECKPOINT OUT_DIR`: a training checkpoint as a HF model directory (safetensors).

The checkpoint's sharded weights (any strategy) are gathered into the
unsharded model that its `config.json` describes and written with
`save_pretrained`, so `transformers` loads them and gives the run's logits.
Tokenizer files of a local base model are copied along when present.
"""

from __future__ import annotations

import json
import os
import shutil

from hp.train import checkpoint

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt")


def export(checkpoint_dir: str, out_dir: str) -> str:
    """Write `checkpoint_dir`'s model to `out_dir` as HF safetensors; returns `out_dir`.

    >>> export("/nonexistent", "/tmp/x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    FileNotFoundError: ...
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint.require_complete(checkpoint_dir)
    config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config)
    checkpoint.load_model_weights(checkpoint_dir, model)
    model.save_pretrained(out_dir, safe_serialization=True)
    _copy_tokenizer(checkpoint_dir, out_dir)
    return out_dir


def _copy_tokenizer(checkpoint_dir: str, out_dir: str) -> None:
    """Tokenizer files of the run's base model, found through the run's hp_config.json."""
    run_config = os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), "hp_config.json")
    if not os.path.isfile(run_config):
        return
    with open(run_config) as f:
        base = json.load(f).get("model_name_or_path", "")
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), out_dir)

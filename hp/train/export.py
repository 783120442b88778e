"""`hp export CHECKPOINT OUT_DIR`: a training checkpoint as a HF model directory (safetensors).

The checkpoint's sharded weights (any strategy) are gathered into the
unsharded model that its `config.json` describes and written with
`save_pretrained`, so `transformers` loads them and gives the run's logits.
The tokenizer files the checkpoint carries go along, so the directory is a
complete model: `hp train` continues from it (`model_name_or_path: OUT_DIR`).
"""

from __future__ import annotations

import os
import shutil

from hp.train import checkpoint

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja")


def export(checkpoint_dir: str, out_dir: str) -> str:
    """Write `checkpoint_dir`'s model and tokenizer to `out_dir` as a HF model directory; returns `out_dir`.

    >>> export("/nonexistent", "/tmp/x")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    hp.train.checkpoint.CheckpointError: ...
    """
    from transformers import AutoConfig

    from hp.train.model import model_class

    checkpoint.require_complete(checkpoint_dir)
    config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    model = model_class(config).from_config(config)
    checkpoint.load_model_weights(checkpoint_dir, model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(checkpoint_dir, name)):
            shutil.copy(os.path.join(checkpoint_dir, name), out_dir)
    return out_dir

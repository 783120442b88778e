"""What the `hp train` tests share: running the command, reading its results, a local HF model directory.

Every run is a real `hp train` subprocess (torch's elastic launcher and gloo
workers when the strategy has more than one rank) from the repository root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gloo_launch import _free_port, clean_env

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
DATA = str(ROOT / "examples" / "data")


def hp_train(*overrides: str, config: str = QUICKSTART, wait: bool = True):
    command = [sys.executable, "-m", "hp.cli", "train", config, f"dataset_dir={DATA}",
               f"master_port={_free_port()}", *overrides]
    if not wait:
        return subprocess.Popen(command, env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)


def summary(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def losses(output_dir: Path) -> dict[int, float]:
    with open(output_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def first_batch(overrides: list[str]):
    """The global batch the first step of `hp train QUICKSTART *overrides` draws, computed here."""
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples
    from hp.train.tokenizer import load_tokenizer

    config = load_config(QUICKSTART, overrides)
    tokenizer = load_tokenizer(config.model_name_or_path)
    batch = config.per_device_train_batch_size * config.parallel.dp
    return next(TokenBatches(load_examples(config, tokenizer), batch, config.seed, tokenizer.pad_token_id))


def local_hf_model(directory: Path, family: str = "llama") -> None:
    """A tiny model of `family` saved as a HF directory: config, safetensors and a locally trained BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hp.models import tiny_config

    records = json.loads((Path(DATA) / "quickstart.json").read_text())
    text = [" ".join(r.values()) for r in records[:200]]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(3)
    config = tiny_config(family, layers=2, vocab_size=320, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)



"""Worker for the tests of models read from local HF directories: many `hp train` runs in one launch.

Arguments: a JSON file of cases (`{"name", "overrides", "logits"}`: `hp train`'s key=value overrides, model
path and strategy among them), the config file, and an output directory. For each case the worker runs
`hp train`'s loop on the config (the same model building, rank-by-rank loading and training as the
command); with `logits` it first builds the model as `hp train` does (`hp.train.model.build_model`: laid
out on the meta device, then each rank reads its blocks) and writes its logits on a fixed batch before any
step (`NAME.pt`, gathered whole; not under pipeline parallel, whose stages hold no whole forward). Rank 0
prints `{name: {"first": first loss, "losses": [loss of each logged step]}}` as its last line. One launch
instead of one per case: each launch costs seconds of start-up.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hp
from hp.train.config import load_config
from hp.train.data import load_tokenizer
from hp.train.loop import train
from hp.train.model import build_model, resolved_strategy, model_config

BATCH = (4, 16)  # rows and tokens of the batch whose logits are compared


def batch(vocab_size: int) -> torch.Tensor:
    """The batch every case's logits are computed on (the test computes HF's on it too)."""
    return torch.randint(0, vocab_size, BATCH, generator=torch.Generator().manual_seed(0))


def logits(config) -> torch.Tensor:
    tokenizer = load_tokenizer(config.model_name_or_path)
    strategy = resolved_strategy(config, model_config(config.model_name_or_path, tokenizer.vocab_size))
    mesh = hp.strategy_mesh(strategy)
    model = build_model(config.model_name_or_path, tokenizer.vocab_size, mesh, strategy, seed=config.seed,
                        finetuning=config.finetuning)
    with torch.no_grad():
        out = model(input_ids=batch(model.config.vocab_size)).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def main() -> None:
    cases_file, config_file, out = sys.argv[1:4]
    with open(cases_file) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        name = case["name"]
        config = load_config(config_file, [*case["overrides"], f"output_dir={os.path.join(out, name)}"])
        if case["logits"] and config.parallel.pp == 1:
            whole = logits(config)
            if dist.get_rank() == 0:
                torch.save(whole, os.path.join(out, f"{name}.pt"))
        first = train(config)["first_loss"]
        if dist.get_rank() == 0:
            with open(os.path.join(out, name, "metrics.jsonl")) as f:
                results[name] = {"first": first, "losses": [r["loss"] for r in map(json.loads, f) if "loss" in r]}
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo may abort in its destructors at exit after a finished run


if __name__ == "__main__":
    main()

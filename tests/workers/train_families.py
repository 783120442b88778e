"""Worker for test_train.py: hp's trainer on a local HF directory of every zoo family, in one launch.

Arguments: a directory holding one model directory per family (config, safetensors,
tokenizer), the dataset directory, the config file and the families (comma-separated). For each family the worker runs the
training loop of `hp train` (the same config path, model building and rank-by-rank
loading as the command) for one step at tp = the world size, and rank 0 prints
`{family: first_loss}` as its last line. One launch instead of one per family:
each launch costs seconds of start-up.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from hp.train.config import load_config
from hp.train.loop import train


def main() -> None:
    models, data, config_file, families = sys.argv[1:5]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = {}
    for family in families.split(","):
        overrides = [f"model_name_or_path={os.path.join(models, family)}", "max_steps=1", "save_steps=1000",
                     "per_device_train_batch_size=8", f"parallel.tp={world}", f"dataset_dir={data}",
                     f"output_dir={os.path.join(models, 'out', family)}"]
        first[family] = train(load_config(config_file, overrides))["first_loss"]
    if dist.get_rank() == 0:
        print(json.dumps(first), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo may abort in its destructors at exit after a finished run


if __name__ == "__main__":
    main()

"""For test_train.py: a save that crashes half-way never damages the previous checkpoint.

Copies a finished run, resumes its last checkpoint in one process, then saves
again with the sharded writer failing after it has written part of the new
checkpoint (as a killed process would). The previous checkpoint must stay the
latest and still load; prints what it found as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaForCausalLM

from hp.train import checkpoint
from hp.train.data.embedded import tiny_llama_config


def fresh():
    model = LlamaForCausalLM(tiny_llama_config(259))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(run_dir: str, scratch: str) -> None:
    out = os.path.join(scratch, "run")
    shutil.copytree(run_dir, out)
    model, optimizer = fresh()
    state = checkpoint.load(checkpoint.latest(out), model, optimizer)
    real_save = dcp.save

    def crash(state_dict, checkpoint_id, **kwargs):
        real_save({"model": state_dict["model"]}, checkpoint_id=checkpoint_id, **kwargs)  # part of it lands
        raise KeyboardInterrupt("killed during the save")

    checkpoint.dcp.save = crash
    try:
        checkpoint.save(out, 9, model, optimizer, {k: v for k, v in state.items() if k != "step"})
    except KeyboardInterrupt:
        pass
    finally:
        checkpoint.dcp.save = real_save
    latest = checkpoint.latest(out)
    model, optimizer = fresh()
    assert checkpoint.load(latest, model, optimizer)["step"] == 6
    print(json.dumps({"latest": os.path.basename(latest), "partial_left": os.path.isdir(os.path.join(out, "checkpoint-9.partial"))}))


if __name__ == "__main__":
    main(*sys.argv[1:])

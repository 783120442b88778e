"""Training checkpoints: sharded, resumable under another strategy, and atomic.

The model and optimizer go through `torch.distributed.checkpoint` (each rank
writes its own blocks; loading reshards, so a run saved at tp=2 resumes at
tp=1 or dp=2). Beside them, rank 0 writes `trainer_state.pt` (step,
scheduler, data position, RNG states) and the model's `config.json`.

Atomicity: everything is written into `checkpoint-N.partial/`, and only when
every rank has finished does rank 0 rename it to `checkpoint-N` (one rename,
atomic on POSIX). A crash during a save leaves a `.partial` directory that
`latest` ignores, and never touches the previous checkpoint. On several nodes
`output_dir` must be a shared filesystem.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hp.storable import from_storable, to_storable

_NAME = re.compile(r"checkpoint-(\d+)\Z")
TRAINER_STATE = "trainer_state.pt"


def latest(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step in `output_dir` (None when there is none).

    >>> latest("/nonexistent") is None
    True
    """
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for n in os.listdir(output_dir) if (m := _NAME.match(n))]
    steps = [s for s in steps if os.path.isfile(os.path.join(output_dir, f"checkpoint-{s}", TRAINER_STATE))]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def save(output_dir: str, step: int, model: nn.Module, optimizer, extra: dict[str, Any], keep: int | None = None) -> str:
    """Write checkpoint-`step` atomically; `extra` (scheduler, data position, ...) goes into trainer_state.pt."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    partial = final + ".partial"
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # debris of a crashed save of this step
        os.makedirs(partial)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = to_storable({"model": model_state, "optim": optim_state})
    dcp.save(state, checkpoint_id=partial, no_dist=not distributed())
    if rank() == 0:
        state = {"step": step, "rng": _rng_state(), **extra}
        torch.save(state, os.path.join(partial, TRAINER_STATE))
        model.config.to_json_file(os.path.join(partial, "config.json"))
    _barrier()
    if rank() == 0:
        if os.path.exists(final):  # a stale checkpoint of this step (an earlier, diverged run)
            shutil.rmtree(final)
        os.rename(partial, final)
        _prune(output_dir, keep)
    _barrier()
    return final


def load(path: str, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG from checkpoint `path` into this run's layout; returns trainer state."""
    require_complete(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    wanted = {"model": model_state, "optim": optim_state}
    state = to_storable(wanted)
    dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    state = from_storable(state, wanted)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = torch.load(os.path.join(path, TRAINER_STATE), weights_only=False)
    _set_rng_state(trainer.pop("rng"))
    return trainer


def load_model_weights(path: str, model: nn.Module) -> None:
    """Only the model's weights of checkpoint `path` (for export and evaluation)."""
    wanted = {"model": model.state_dict()}
    state = to_storable(wanted)
    dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    model.load_state_dict(from_storable(state, wanted)["model"])


def _prune(output_dir: str, keep: int | None) -> None:
    if not keep:
        return
    steps = sorted(int(m.group(1)) for n in os.listdir(output_dir) if (m := _NAME.match(n)))
    for step in steps[:-keep]:
        shutil.rmtree(os.path.join(output_dir, f"checkpoint-{step}"), ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.accelerator.is_available():
        index = torch.accelerator.current_device_index()
        state["accelerator"] = torch.get_device_module(torch.accelerator.current_accelerator()).get_rng_state(index)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and torch.accelerator.is_available():
        index = torch.accelerator.current_device_index()
        torch.get_device_module(torch.accelerator.current_accelerator()).set_rng_state(state["accelerator"], index)


def distributed() -> bool:
    """Whether this process is one rank of a process group (else DCP reads and writes alone)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 when it runs alone."""
    return dist.get_rank() if distributed() else 0


def require_complete(path: str) -> None:
    """Refuse a directory that is not a finished checkpoint (a `.partial` one, or no checkpoint at all)."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise FileNotFoundError(f"{path} is not a complete hp checkpoint (no {TRAINER_STATE})")


def _barrier() -> None:
    if distributed():
        dist.barrier()

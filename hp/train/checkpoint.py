"""Training checkpoints: sharded, resumable under another strategy, and atomic.

The model and optimizer go through `torch.distributed.checkpoint` (each rank
writes its own blocks; loading reshards, so a run saved at tp=2 resumes at
tp=1 or dp=2). Beside them, rank 0 writes `trainer_state.pt` (step,
scheduler, data position, RNG states), the model's `config.json` and the
tokenizer's files, so that a checkpoint exports to a complete HF model.

Atomicity: everything is written into `checkpoint-N.partial/`, and only when
every rank has finished does rank 0 write its manifest (`hp.train.manifest`:
each file's size and checksum) and rename it to `checkpoint-N` (one rename,
atomic on POSIX). `latest` takes the newest checkpoint whose files match
their manifest, passing over damaged ones. A crash during a save leaves a `.partial` directory that
`latest` ignores, and never touches the previous checkpoint. On several nodes
`output_dir` must be a shared filesystem.

Safety: a checkpoint may come from elsewhere (a shared run to resume), so
nothing in it is unpickled freely. `trainer_state.pt` is read with
`torch.load(weights_only=True)` (plain containers, tensors, numbers, RNG
states), and DCP's `.metadata`, which torch reads with plain `pickle`, is
first read here with an unpickler that builds only DCP's own metadata
classes and torch's sizes, dtypes and layouts; anything else is refused
with a `CheckpointError` naming the file and the object.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from hp.parallel.lora import has_lora, peft_config
from hp.parallel.storable import from_storable, to_storable
from hp.train import manifest

_NAME = re.compile(r"checkpoint-(\d+)\Z")
# The optimizer's state and settings keyed by parameter name, not by position in its groups: a rank that holds
# some of the parameters (a pipeline stage) saves and loads just theirs, under any other split.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_GROUP_LIST = re.compile(r"optim\.param_groups\.\d+\.params")  # how a list of groups was stored
TRAINER_STATE = "trainer_state.pt"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's, beside the weights of a LoRA run
_METADATA = ".metadata"  # DCP's index of the blocks, a pickle
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_FUNCTIONS = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                       ("collections", "OrderedDict")}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed or exported: incomplete, unreadable, or holding unsafe objects."""


def latest(output_dir: str, skipped: list[tuple[str, str]] | None = None) -> str | None:
    """The complete checkpoint with the highest step in `output_dir` whose files match its manifest (None
    when there is none); each newer one passed over is added to `skipped` as (path, why).

    >>> latest("/nonexistent") is None
    True
    """
    for path in finished(output_dir):
        damage = manifest.verify(path)
        if damage is None:
            return path
        if skipped is not None:
            skipped.append((path, damage))
    return None


def finished(output_dir: str) -> list[str]:
    """The checkpoints in `output_dir` whose save finished, newest first (their files not read: see `latest`).

    >>> finished("/nonexistent")
    []
    """
    if not os.path.isdir(output_dir):
        return []
    steps = sorted((int(m.group(1)) for n in os.listdir(output_dir) if (m := _NAME.match(n))), reverse=True)
    paths = [os.path.join(output_dir, f"checkpoint-{step}") for step in steps]
    return [p for p in paths if os.path.isfile(os.path.join(p, TRAINER_STATE))]  # the rename publishes finished ones


def on_rank_zero(choose: Callable[[], Any]) -> Any:
    """`choose()` run by rank 0 alone, and its result (or its error) handed to every rank: choosing a
    checkpoint reads its files back against the manifest, once per run rather than once per rank.

    >>> on_rank_zero(lambda: "checkpoint-3")
    'checkpoint-3'
    """
    if not distributed():
        return choose()
    box: list[Any] = [None]
    if rank() == 0:
        try:
            box[0] = (True, choose())
        except Exception as error:  # noqa: BLE001 - every rank raises it, not rank 0 alone
            box[0] = (False, error)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def save(output_dir: str, step: int, model: nn.Module, optimizer, extra: dict[str, Any], *, tokenizer=None,
         keep: int | None = None, model_only: bool = False, base_model: str | None = None) -> str:
    """Write checkpoint-`step` atomically and wait for it (see `Saver` for the options); returns its path."""
    return Saver(output_dir, keep=keep).save(step, model, optimizer, extra, tokenizer=tokenizer,
                                             model_only=model_only, base_model=base_model)


class Saver:
    """A run's checkpoints, written atomically; with `background`, while training goes on.

    `extra` (scheduler, data position, ...) goes into trainer_state.pt. `model_only` leaves the optimizer
    state out (LlamaFactory's `save_only_model`): such a checkpoint exports, but does not resume. A model
    with LoRA adapters also gets PEFT's `adapter_config.json` (`base_model`: the model the adapters were
    trained on), which `hp export` reads.

    A background save (DCP's `async_save`) copies the model's and optimizer's blocks to host memory before
    `save` returns, so the next update cannot change what is written, and writes them on a thread of DCP's.
    That thread coordinates the ranks over a gloo group of its own: collectives on the training's group
    from a second thread would interleave with the training's. The checkpoint is published (manifest,
    rename) by `finish`, at the next save or at the end of the run; a run that dies before that has the
    previous checkpoint as its last complete one, exactly as when a synchronous save is cut short.

    >>> Saver("/tmp/run", background=True).finish() is None  # nothing pending
    True
    """

    def __init__(self, output_dir: str, *, keep: int | None = None, background: bool = False) -> None:
        self.output_dir, self.keep, self.background = output_dir, keep, background
        self._pending: tuple[str, Any] | None = None  # (the checkpoint's final path, DCP's future or None)
        self._group = None

    def save(self, step: int, model: nn.Module, optimizer, extra: dict[str, Any], *, tokenizer=None,
             model_only: bool = False, base_model: str | None = None) -> str:
        """Begin checkpoint-`step` (finishing the one before); its path. With `background` it is published by
        `finish`, else before this returns."""
        self.finish()
        final = os.path.join(self.output_dir, f"checkpoint-{step}")
        partial = final + ".partial"
        if rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # debris of a crashed save of this step
            os.makedirs(partial)
        _barrier()
        model_state, optim_state = _states(model, optimizer, _FLAT)
        state = to_storable({"model": model_state} if model_only else {"model": model_state, "optim": optim_state})
        if rank() == 0:
            _write_beside(partial, model, {"step": step, "rng": _rng_state(), "model_only": model_only, **extra},
                          tokenizer, base_model)
        if self.background:
            future = dcp.async_save(state, checkpoint_id=partial, process_group=self._saving_group(),
                                    no_dist=not distributed())
            self._pending = (final, future)
        else:
            dcp.save(state, checkpoint_id=partial, no_dist=not distributed())
            self._pending = (final, None)
            self.finish()
        return final

    def finish(self) -> str | None:
        """Wait for the checkpoint being written and publish it; its path (None when none was pending)."""
        if self._pending is None:
            return None
        final, future = self._pending
        self._pending = None
        if future is not None:
            future.result()  # raises what the writing thread raised
        _barrier()
        if rank() == 0:
            partial = final + ".partial"
            manifest.write(partial)  # last: every file is in place
            if os.path.exists(final):  # a stale checkpoint of this step (an earlier, diverged run)
                shutil.rmtree(final)
            os.rename(partial, final)
            _prune(self.output_dir, self.keep)
        _barrier()
        return final

    def close(self) -> str | None:
        """`finish`, then let the saving group go; the last checkpoint's path (None when none was pending)."""
        final = self.finish()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        return final

    def _saving_group(self):
        if self._group is None and distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group


def _write_beside(partial: str, model: nn.Module, trainer: dict[str, Any], tokenizer, base_model: str | None) -> None:
    """Rank 0's files beside the blocks: the trainer state, the model's config, LoRA's and the tokenizer's."""
    torch.save(trainer, os.path.join(partial, TRAINER_STATE))
    model.config.to_json_file(os.path.join(partial, "config.json"))
    if has_lora(model):
        with open(os.path.join(partial, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config(model, base_model), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)


def load(path: str, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG from checkpoint `path` into this run's layout; returns trainer state.

    `path` was checked against its manifest where it was chosen (the launcher, or `on_rank_zero`); every
    rank reading it all back again would cost the run a reading per rank."""
    trainer = trainer_state(path, check_files=False)
    options = _FLAT if _flat_optimizer(path) else StateDictOptions()
    model_state, optim_state = _states(model, optimizer, options)
    wanted = {"model": model_state, "optim": optim_state}
    state = to_storable(wanted)
    dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    state = from_storable(state, wanted)
    if optim_state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    elif model_state:  # a rank whose part trains nothing (`_states`)
        set_model_state_dict(model, state["model"], options=options)
    _set_rng_state(trainer.pop("rng"))
    return trainer


def _states(model: nn.Module, optimizer, options: StateDictOptions) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts, as the checkpoint holds them; none for a rank that holds no
    part of the model (it runs only a placed frozen program: `hp.train.placed`), which still takes part in
    the collective save); no optimizer state for a rank whose part is all frozen (a frozen tower placed beside
    the pipeline), whose AdamW holds no weights."""
    if not model.state_dict():
        return {}, {}
    if not _trains(optimizer):
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, optimizer, options=options)


def _trains(optimizer) -> bool:
    return any(group["params"] for group in optimizer.param_groups)


def trainer_state(path: str, *, check_files: bool = True) -> dict[str, Any]:
    """The trainer state of complete checkpoint `path`, after checking that nothing in it runs code on loading
    (and, with `check_files`, that its files match its manifest).

    >>> trainer_state("/nonexistent")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hp.train.checkpoint.CheckpointError: /nonexistent is not a complete hp checkpoint (no trainer_state.pt)
    """
    require_complete(path, check_files=check_files)
    _check_metadata(path)
    file = os.path.join(path, TRAINER_STATE)
    try:
        state = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else "an object that is not a tensor, number, string or container"
        raise CheckpointError(f"{file} holds {what}, which loading would have to run as code; refusing it "
                              "(a trainer state holds only tensors, numbers, strings and containers)") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from None
    missing = [k for k in ("step", "rng", "scheduler", "data") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{file} is not an hp trainer state: it lacks {', '.join(missing)}")
    if state.get("model_only"):
        raise CheckpointError(f"{path} was saved with save_only_model: true, so it holds no optimizer state to resume "
                              f"from; `hp export {path} DIR` and train from DIR instead")
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and torch's sizes, dtypes and layouts; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if _plain_metadata(module, name):
            return super().find_class(module, name)
        raise CheckpointError(f"{module}.{name}")


def _plain_metadata(module: str, name: str) -> bool:
    if module in _METADATA_MODULES:
        found = getattr(importlib.import_module(module), name, None)
        return isinstance(found, type) and found.__module__ == module
    if module == "torch":
        found = getattr(torch, name, None)
        return found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) in _METADATA_FUNCTIONS


def _check_metadata(path: str) -> None:
    """Read DCP's pickled index of `path` with `_MetadataUnpickler` before torch reads it with plain pickle."""
    file = os.path.join(path, _METADATA)
    try:
        with open(file, "rb") as f:
            _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{file} holds {e}, which loading would have to run as code; refusing it "
                              "(DCP metadata holds only its own records, sizes and dtypes)") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read as DCP metadata: {e}") from None


def _flat_optimizer(path: str) -> bool:
    """Whether checkpoint `path` keeps the optimizer's settings per parameter name (`_FLAT`), as hp writes
    now; older checkpoints kept one list of parameter groups, and still load."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return not any(_GROUP_LIST.fullmatch(key) for key in keys)


def holds(path: str, weight: str) -> bool:
    """Whether checkpoint `path` holds the model weight named `weight` (its metadata is read, not the data)."""
    _check_metadata(path)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return f"model.{weight}" in keys


def load_model_weights(path: str, model: nn.Module) -> None:
    """Only the model's weights of checkpoint `path` (for export and evaluation)."""
    _check_metadata(path)
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
    """Whether this process is one rank of a process group with peers (else DCP reads and writes alone).

    A `fake` group (`hp.mesh(simulate=True)`) has none: its object collectives carry no data.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def rank() -> int:
    """This process's rank, 0 when it runs alone."""
    return dist.get_rank() if distributed() else 0


def require_complete(path: str, *, check_files: bool = True) -> None:
    """Refuse a directory that is not a finished checkpoint (a `.partial` one, or no checkpoint at all), or
    (with `check_files`) whose files differ from its manifest, naming the damaged file."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise CheckpointError(f"{path} is not a complete hp checkpoint (no {TRAINER_STATE})")
    damage = manifest.verify(path) if check_files else None
    if damage is not None:
        raise CheckpointError(f"{path} is damaged: {damage}")


def _barrier() -> None:
    if distributed():
        dist.barrier()

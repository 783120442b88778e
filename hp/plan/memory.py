"""One rank's memory over a training step, by kind, from the step hp train runs, on fake tensors.

Why: the model states are arithmetic on the layouts (`hp.plan.dry_run`), but
what a step holds beside them (activations saved for backward, gradients
while they accumulate, the temporaries of attention and the loss, the
buffers of collectives) depends on every op the step runs. hp answers it
by running that step on fake tensors (`hp.plan.step.fake_step`: the model
laid out on a fake process group of the target world, shapes and no
storage), where torch's `MemTracker` counts every storage the step
allocates, by kind, and keeps the breakdown at the step's peak. The step
tracked is the second, the one every later step repeats (the first makes
AdamW's states and what later steps reuse). Storages are rounded up to 512
bytes, as accelerator caching allocators round them (torch's `MemTracker`
does).

A collective library may allocate beside the tensors it is handed, and a
fake process group allocates nothing: `LIBRARY_BUFFERS` says, per backend,
which collectives hold a buffer the size of their input while they run, and
the trace allocates it there (a device profile names its backend).

`measure_step` tracks the same step on real tensors (`hp.plan.step.real_step`),
so that a prediction can be checked against what was allocated.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from hp.parallel.strategy import Strategy
from hp.plan.step import Step, StepShape, fake_step, real_step
from hp.train.finetuning import Finetuning

# Per backend, the c10d ops whose library copies their whole input while they run (measured on 2 processes here, a
# 4 MiB input: gloo's `reduce_scatter_single`, FSDP's reduce-scatter, peaks 4 MiB above its input and output; its
# list form, all-gather, all-reduce and the functional collectives DTensor issues allocate nothing of their own).
# NCCL and HCCL reduce in the buffers they are given: their staging lies outside the framework's allocator.
LIBRARY_BUFFERS: dict[str, frozenset[str]] = {"gloo": frozenset({"_reduce_scatter_base_"}), "nccl": frozenset(),
                                              "hccl": frozenset()}
# MemTracker's kinds, as hp plan names them
_KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer_states",
          "Activation": "activations", "Temp": "temporaries", "Input": "inputs", "Other": "other"}


@dataclass(frozen=True)
class StepMemory:
    """The bytes one rank holds at its step's peak, by kind; `peak` is their sum."""

    parameters: int
    buffers: int
    gradients: int
    optimizer_states: int
    activations: int  # saved for backward, and recomputed ones
    temporaries: int  # gradients of activations, kernels' and collectives' outputs in flight
    inputs: int
    other: int
    peak: int
    model_states: int  # parameters, gradients and optimizer states held as the update starts (every gradient made)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def trace_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
               finetuning: Finetuning | None = None, *, backend: str | None = None) -> StepMemory:
    """Rank 0's memory over one training step of `hf_config`'s model under `strategy`, traced on fake tensors,
    with `backend`'s own buffers (`LIBRARY_BUFFERS`; None: none).

    >>> from hp.models import tiny_config
    >>> memory = trace_step(tiny_config("llama", layers=2), {"tp": 2}, StepShape(rows=4, tokens=32))
    >>> memory.optimizer_states > 2 * memory.parameters  # AdamW: two moments of each parameter rank 0 holds, and steps
    True
    >>> memory.peak == sum(bytes_ for kind, bytes_ in memory.to_dict().items() if kind not in ("peak", "model_states"))
    True
    """
    with fake_step(hf_config, strategy, shape, finetuning) as step:
        return memory_of(step, backend)


def measure_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
                 finetuning: Finetuning | None = None, *, seed: int = 0) -> StepMemory:
    """`trace_step`'s step run on real tensors, tracked alike: what this rank allocated.

    On the real process group when one is initialised (its world must be the strategy's), else on a fake one of the
    strategy's size (collectives move nothing, every tensor is allocated as in a real run): `real_step`.

    >>> from hp.models import tiny_config
    >>> config, shape = tiny_config("llama", layers=2), StepShape(rows=4, tokens=32)
    >>> measure_step(config, {"tp": 2}, shape) == trace_step(config, {"tp": 2}, shape)
    True
    """
    return memory_of(real_step(hf_config, strategy, shape, finetuning, seed=seed))


def memory_of(step: Step, backend: str | None = None, *,
              inside: contextlib.AbstractContextManager = contextlib.nullcontext()) -> StepMemory:
    """`step` (made by `fake_step` or `real_step`) run once more under the tracker: its peak by kind, and the model
    states as its update starts; with `backend`, the buffers its library allocates that the step's process group
    does not (a fake one's). `inside` is entered within the tracker around the run (another count of the same run,
    allocating nothing: `hp.plan.step_time.WorkCount`).

    >>> memory_of(None, "mpi")
    Traceback (most recent call last):
    ...
    ValueError: backend 'mpi' is not one hp plan knows the buffers of (gloo, nccl, hccl)
    """
    if backend is not None and backend not in LIBRARY_BUFFERS:
        raise ValueError(f"backend {backend!r} is not one hp plan knows the buffers of ({', '.join(LIBRARY_BUFFERS)})")
    tracker, at_update = _StepTracker(), {}
    tracker.track_external(step.model, step.optimizer, *step.inputs.values())

    def states_now() -> None:
        at_update.update(next(iter(tracker.get_tracker_snapshot("current").values()), {}))

    library = _LibraryBuffers(LIBRARY_BUFFERS[backend]) if backend else contextlib.nullcontext()
    with tracker, library, inside, warnings.catch_warnings():
        # its module tracker warns when recompute runs a block's forward again inside backward; this reads no
        # per-module figure, only the step's totals
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        step.run(before_update=states_now)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    kinds = {name: snapshot.get(kind, 0) for kind, name in _KINDS.items()}
    states = sum(at_update.get(kind, 0) for kind in ("Parameter", "Gradient", "Optstate"))
    return StepMemory(**kinds, peak=snapshot.get("Total", 0), model_states=states)


class _StepTracker(MemTracker):
    """torch's `MemTracker` keeping the step's peak only: its per-module peaks, which this does not read, walk
    every module the step has entered at every op (three quarters of a trace's time). A frozen parameter (LoRA's
    base weights) gets no gradient hook, which torch refuses on a tensor that needs no gradient."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        for param in module.parameters():  # FSDP swaps its parameters in and out: each one as it comes
            if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


class _LibraryBuffers(TorchDispatchMode):
    """Each collective in `ops` (c10d's in-place ones: output, then input) holds a buffer of its input's size while
    it runs, as its library does on a real process group. Entered inside the tracker, which counts the buffer."""

    def __init__(self, ops: frozenset[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.partition("::")[2] not in self.ops:
            return func(*args, **(kwargs or {}))
        staged = torch.empty_like(args[1])
        try:
            return func(*args, **(kwargs or {}))
        finally:
            del staged


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()

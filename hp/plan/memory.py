"""One rank's memory over a training step, by kind, from the step hp train runs, on fake tensors.

Why: the model states are arithmetic on the layouts (`hp.plan.dry_run`), but
what a step holds beside them (activations saved for backward, gradients
while they accumulate, the temporaries of attention and the loss, the
buffers of collectives) depends on every op the step runs. hp answers it
by running that step: the model is built on the meta device, laid out by
`apply_strategy` on a fake process group of the target world (as on real
processes: plain data parallel where a run takes it), its
parameters made `FakeTensor`s (shapes, no storage), and one step of
`hp train` (the loss, backward, the gradients reduced, AdamW's update, the
gradients dropped) runs under `FakeTensorMode`. The gradients' clipping
reads their norm, a number a fake tensor does not hold: it is taken as over
the limit, so that the clip scales them, as in a run's early steps.
torch's `MemTracker` counts every storage the step allocates, by kind, and
keeps the breakdown at the step's peak.

The step traced is the second: AdamW makes its states on its first update,
and a first step makes what later ones reuse (FSDP's and DTensor's lazy
state), so the first step runs untracked and the second is the one every
later step repeats. Storages are rounded up to 512 bytes, as accelerator
caching allocators round them (torch's `MemTracker` does).

Three things differ from a plain step under `FakeTensorMode`, each so
that it follows the step a real run takes: the norm above, and
- attention takes the flash kernel (a fake tensor picks the math one,
  which materialises the score matrix that the CPU and GPU kernels never
  hold), and
- transformers' search for packed sequences in `position_ids` is skipped
  (it cannot read fake values, and on a fake tensor builds a whole
  (batch, 1, seq, seq) mask that the real run never builds).

`measure_step` runs the same step on real tensors (the same fake world, or
the real process group when one is initialised), so that a prediction can be
checked against what was allocated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention import SDPBackend, sdpa_kernel

from hp.models import plan_for
from hp.parallel.data_parallel import reduce_gradients
from hp.parallel.plain_dp import as_on_real_processes
from hp.parallel.apply import apply_strategy, strategy_mesh
from hp.parallel.strategy import Strategy
from hp.train.clipping import clip_gradients
from hp.train.data import IGNORE_INDEX
from hp.train.finetuning import Finetuning, apply_finetuning
from hp.train.model import model_class

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


@dataclass(frozen=True)
class StepShape:
    """The batch a step runs: rows on every rank before the strategy splits them (per-device batch x dp), and tokens
    per row."""

    rows: int
    tokens: int
    bf16: bool = False  # forwards under bf16 autocast, as `bf16: true` runs them


def trace_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
               finetuning: Finetuning | None = None) -> StepMemory:
    """Rank 0's memory over one training step of `hf_config`'s model under `strategy`, traced on fake tensors.

    >>> from hp.models import tiny_config
    >>> memory = trace_step(tiny_config("llama", layers=2), {"tp": 2}, StepShape(rows=4, tokens=32))
    >>> memory.optimizer_states > 2 * memory.parameters  # AdamW: two moments of each parameter rank 0 holds, and steps
    True
    >>> memory.peak == sum(bytes_ for kind, bytes_ in memory.to_dict().items() if kind not in ("peak", "model_states"))
    True
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    strategy = Strategy.of(strategy)
    mesh = strategy_mesh(strategy, simulate=True)
    with torch.device("meta"):
        model = _built(hf_config, finetuning)
    _laid_out(model, strategy, mesh)
    with FakeTensorMode(allow_non_fake_inputs=True), _as_a_real_step():
        model.to_empty(device=mesh.device_type)
        return _tracked_step(model, shape, mesh.device_type, fake=True)


def measure_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
                 finetuning: Finetuning | None = None, *, seed: int = 0) -> StepMemory:
    """`trace_step`'s step run on real tensors, tracked alike: what this rank allocated.

    On the real process group when one is initialised (its world must be the strategy's), else on a fake one of the
    strategy's size (collectives move nothing, every tensor is allocated as in a real run).

    >>> from hp.models import tiny_config
    >>> config, shape = tiny_config("llama", layers=2), StepShape(rows=4, tokens=32)
    >>> measure_step(config, {"tp": 2}, shape) == trace_step(config, {"tp": 2}, shape)
    True
    """
    strategy = Strategy.of(strategy)
    simulate = not torch.distributed.is_initialized() or torch.distributed.get_backend() == "fake"
    mesh = strategy_mesh(strategy, simulate=simulate)
    torch.manual_seed(seed)
    model = _laid_out(_built(hf_config, finetuning), strategy, mesh).to(mesh.device_type)
    return _tracked_step(model, shape, mesh.device_type)


def config_step(config, hf_config) -> tuple[Strategy, StepShape, Finetuning]:
    """The step an `hp train` config runs, as `trace_step` takes it: its strategy, its batch (per-device rows times
    dp, which the strategy splits; `cutoff_len` tokens each, the longest a batch holds; bf16 as it says) and its
    finetuning. What hp plan cannot trace yet is refused by name (a ValueError).

    >>> from hp.train.config import validate
    >>> from hp.models import tiny_config
    >>> config = validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "cutoff_len": 32,
    ...                    "parallel": {"dp": 2, "fsdp": True}})
    >>> trace_step(tiny_config("llama"), *config_step(config, tiny_config("llama"))).peak > 0
    True
    """
    strategy = config.parallel
    if strategy.pp > 1 or strategy.mpmd_place is not None:
        raise ValueError("hp plan traces no pipelined or placed step yet: their stages are cut by hp train's runner")
    if plan_for(hf_config).experts:
        raise ValueError("hp plan traces no mixture-of-experts step yet: its routing decides the experts' shapes")
    if config.stage not in ("pt", "sft") or getattr(hf_config, "vision_config", None) is not None:
        raise ValueError(f"hp plan traces pt and sft steps of text models so far, not {config.stage} of "
                         f"{hf_config.model_type}")
    shape = StepShape(rows=config.per_device_train_batch_size * strategy.dp, tokens=config.cutoff_len,
                      bf16=config.bf16)
    return strategy, shape, config.finetuning


def _built(hf_config, finetuning: Finetuning | None):
    model = model_class(hf_config).from_config(hf_config)
    if finetuning is not None:
        apply_finetuning(model, finetuning, plan_for(hf_config).blocks)
    return model


def _laid_out(model, strategy: Strategy, mesh):
    """`model` laid out by `strategy` as on real processes: plain data parallel where a real run takes it."""
    with as_on_real_processes():
        return apply_strategy(model, mesh, strategy, plan_for(model.config))


def step_inputs(model, shape: StepShape, device: str, *, fake: bool = False) -> tuple[dict, torch.optim.Optimizer]:
    """A batch of `shape` for `model`'s step, and the AdamW of its trained parameters, as hp train makes it."""
    from hp.train.loop import adamw

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (shape.rows, shape.tokens), device=device)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if fake and hasattr(model, "_hp_reducer"):
        # plain data parallel picks each rank's rows and supervised positions by the labels' values, which a fake
        # tensor lacks; every position is supervised here, which the shifted targets say without values
        inputs["shift_labels"] = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    return inputs, adamw([p for p in model.parameters() if p.requires_grad])


def run_step(model, inputs: dict, optimizer, shape: StepShape, device: str, *, fake: bool = False,
             tracker: MemTracker | None = None, at_update: dict | None = None) -> None:
    """One step of hp train's pt and sft objective: the loss, backward, the gradients reduced and clipped, AdamW's
    update; `tracker`'s current figures copied into `at_update` as the update starts."""
    from hp.train.precision import autocast

    with autocast(shape.bf16, device):
        loss = model(**inputs).loss  # the pt and sft objective (hp.train.objectives.LanguageModeling)
    loss.backward()
    reduce_gradients(model)
    clip_gradients([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    if tracker is not None and at_update is not None:
        at_update.update(next(iter(tracker.get_tracker_snapshot("current").values()), {}))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracked_step(model, shape: StepShape, device: str, *, fake: bool = False) -> StepMemory:
    inputs, optimizer = step_inputs(model, shape, device, fake=fake)
    # AdamW makes its states on its first update; a first step also makes what later ones reuse
    run_step(model, inputs, optimizer, shape, device, fake=fake)
    tracker, at_update = _StepTracker(), {}
    tracker.track_external(model, optimizer, *inputs.values())
    with tracker:
        run_step(model, inputs, optimizer, shape, device, fake=fake, tracker=tracker, at_update=at_update)
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


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


@contextlib.contextmanager
def _as_a_real_step() -> Iterator[None]:
    """A fake norm over the clip's limit, attention's flash kernel, and no search for packed sequences (the
    module docstring)."""
    import logging

    import transformers.masking_utils as masking

    from hp.train import clipping

    # a meta kernel that refuses shapes is logged before its caller (hp's blockwise ops) takes another road
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    search = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda *args, **kwargs: None
    read = clipping.scalar
    clipping.scalar = lambda t: math.inf if isinstance(t, FakeTensor) or is_fake(t) else read(t)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        masking.find_packed_sequence_indices = search
        clipping.scalar = read
        fake_log.setLevel(level)

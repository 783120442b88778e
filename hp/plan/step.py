"""The training step `hp plan` traces and measures: hp train's step of a model laid out by a strategy.

Why one module: the step's memory (`hp.plan.memory`) and its time
(`hp.plan.step_time`) are predicted from the same step, traced on fake
tensors, and checked against the same step run on real ones; both must be
the step `hp train` runs (the loss, backward, the gradients reduced and
clipped, AdamW's update, the gradients dropped).

`fake_step` builds the model on the meta device, lays it out by
`apply_strategy` on a fake process group of the target world (as on real
processes: plain data parallel where a run takes it), makes its parameters
`FakeTensor`s (shapes, no storage) and runs the step under
`FakeTensorMode`. `real_step` builds the same on real tensors (on the real
process group when one is initialised, else on the fake world, whose
collectives move nothing). Each runs the step once before handing it over:
AdamW makes its states on its first update, and a first step makes what
later ones reuse (FSDP's and DTensor's lazy state), so the next step is the
one every later step repeats.

Three things differ from a plain step under `FakeTensorMode`, each so that
it follows the step a real run takes:
- the gradients' clipping reads their norm, a number a fake tensor does not
  hold: it is taken as over the limit, so that the clip scales them, as in a
  run's early steps;
- attention takes the flash kernel (a fake tensor picks the math one,
  which materialises the score matrix that the CPU and GPU kernels never
  hold), and
- transformers' search for packed sequences in `position_ids` is skipped
  (it cannot read fake values, and on a fake tensor builds a whole
  (batch, 1, seq, seq) mask that the real run never builds).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from hp.models import plan_for
from hp.parallel.apply import apply_strategy, strategy_mesh
from hp.parallel.data_parallel import reduce_gradients
from hp.parallel.plain_dp import as_on_real_processes
from hp.parallel.strategy import Strategy
from hp.train.clipping import clip_gradients
from hp.train.data import IGNORE_INDEX
from hp.train.finetuning import Finetuning, apply_finetuning
from hp.train.model import model_class


@dataclass(frozen=True)
class StepShape:
    """The batch a step runs: rows on every rank before the strategy splits them (per-device batch x dp), and tokens
    per row."""

    rows: int
    tokens: int
    bf16: bool = False  # forwards under bf16 autocast, as `bf16: true` runs them


@dataclass(frozen=True)
class Step:
    """A model laid out on `mesh`, its batch and its AdamW: one step of hp train's pt and sft objective to `run`."""

    model: Any
    inputs: dict
    optimizer: torch.optim.Optimizer
    shape: StepShape
    mesh: DeviceMesh

    def run(self, before_update=None) -> None:
        """The loss, backward, the gradients reduced and clipped, AdamW's update (`before_update()` called as it
        starts), the gradients dropped."""
        from hp.train.precision import autocast

        with autocast(self.shape.bf16, self.mesh.device_type):
            loss = self.model(**self.inputs).loss  # the pt and sft objective (hp.train.objectives.LanguageModeling)
        loss.backward()
        reduce_gradients(self.model)
        clip_gradients([p for group in self.optimizer.param_groups for p in group["params"]], 1.0)
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def fake_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
              finetuning: Finetuning | None = None) -> Iterator[Step]:
    """Rank 0's step of `hf_config`'s model under `strategy` on fake tensors, run once; the block runs under the
    fake mode (the module docstring).

    >>> from hp.models import tiny_config
    >>> with fake_step(tiny_config("llama", layers=2), {"tp": 2}, StepShape(rows=4, tokens=32)) as step:
    ...     step.run()
    >>> type(step.model.lm_head.weight).__name__, step.mesh.mesh_dim_names
    ('DTensor', ('tp',))
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    strategy = Strategy.of(strategy)
    mesh = strategy_mesh(strategy, simulate=True)
    with torch.device("meta"):
        model = _built(hf_config, finetuning)
    _laid_out(model, strategy, mesh)
    with FakeTensorMode(allow_non_fake_inputs=True), _as_a_real_step():
        model.to_empty(device=mesh.device_type)
        step = _ready(model, shape, mesh, fake=True)
        yield step


def real_step(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
              finetuning: Finetuning | None = None, *, seed: int = 0) -> Step:
    """`fake_step`'s step on real tensors, run once: on the real process group when one is initialised (its world
    must be the strategy's), else on a fake one of the strategy's size."""
    strategy = Strategy.of(strategy)
    simulate = not torch.distributed.is_initialized() or torch.distributed.get_backend() == "fake"
    mesh = strategy_mesh(strategy, simulate=simulate)
    torch.manual_seed(seed)
    model = _laid_out(_built(hf_config, finetuning), strategy, mesh).to(mesh.device_type)
    return _ready(model, shape, mesh)


def config_step(config, hf_config) -> tuple[Strategy, StepShape, Finetuning]:
    """The step an `hp train` config runs, as `fake_step` takes it: its strategy, its batch (per-device rows times
    dp, which the strategy splits; `cutoff_len` tokens each, the longest a batch holds; bf16 as it says) and its
    finetuning. What hp plan cannot trace yet is refused by name (a ValueError).

    >>> from hp.train.config import validate
    >>> from hp.models import tiny_config
    >>> config = validate({"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "cutoff_len": 32,
    ...                    "parallel": {"dp": 2, "fsdp": True}})
    >>> config_step(config, tiny_config("llama"))[1]
    StepShape(rows=2, tokens=32, bf16=False)
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


def _ready(model, shape: StepShape, mesh, *, fake: bool = False) -> Step:
    """`model`'s step on a batch of `shape` with the AdamW of its trained parameters, as hp train makes them, run
    once."""
    from hp.train.loop import adamw

    device = mesh.device_type
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (shape.rows, shape.tokens), device=device)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if fake and hasattr(model, "_hp_reducer"):
        # plain data parallel picks each rank's rows and supervised positions by the labels' values, which a fake
        # tensor lacks; every position is supervised here, which the shifted targets say without values
        inputs["shift_labels"] = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    step = Step(model, inputs, adamw([p for p in model.parameters() if p.requires_grad]), shape, mesh)
    step.run()
    return step


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
    clipping.scalar = lambda t: math.inf if is_fake(t) else read(t)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        masking.find_packed_sequence_indices = search
        clipping.scalar = read
        fake_log.setLevel(level)

"""hp: named-axis layouts on PyTorch DTensor, JAX-style.

This module only re-exports the public API. The package, from the top layer
down (a layer imports only from those below it; `pyproject.toml` states the
contract and `tests/test_architecture.py` checks it):

    cli              the `hp` command
    train            `hp train`: config/, data/, the loop, checkpoints, export
    models           the zoo (the repository's models/), one plan per family
    offload, mpmd    the transforms of a training step
    parallel         applying a strategy: Strategy, ModelPlan, FSDP, sequences, ...
    compat           what older torch releases lack
    ops              per-op rules and distributed kernels, `hp.region`
    explain, comm    diagnostics: `hp.explain`, `hp.strict`, `hp.comm.trace`
    layouts          the notation and the Layout value
    simulate, watch  simulated ranks; the dispatch-level vantage point
    mesh, cost, source, plot, device    meshes, byte formulas, user lines, drawings, device detection

`hp.offload` and `hp.mpmd` name the transforms; their modules are reached as
`from hp.offload.plan import ...`.

>>> import hp, torch
>>> mesh = hp.mesh(dp=2, tp=4, simulate=True)  # or hp.mesh(dp=2, tp=4) under torchrun
>>> x = hp.shard(torch.randn(8, 16), "b/dp h/tp", mesh)
>>> hp.describe(x)
'f32[b=8/dp, h=16/tp]'
"""

from hp.compat import models_finder  # noqa: F401  first: lets a source tree, whose zoo sits beside hp/, import hp.models
from hp.compat import backports, local_tensor

backports.install()  # before any layout: what this torch release lacks
local_tensor.install()  # hp.simulated's shortcuts: metadata answered at once, no RNG state around plain ops
from hp.layouts import (
    Layout,
    LayoutError,
    Rules,
    constrain,
    describe,
    from_local,
    layout,
    layout_of,
    rules,
    shard,
)
from hp.explain import StrictError, explain, strict
from hp.mesh import MeshError, mesh
from hp.ops import RuleError, rule
from hp.ops.context_parallel import context_parallel
from hp.parallel.parallelize import PlanError, parallelize
from hp.ops.region import region
from hp.parallel.replicated import run_replicated
from hp.simulate import simulated
from hp.parallel.strategy import Strategy, StrategyError
from hp.parallel.model_plan import ModelPlan
from hp.parallel.apply import apply_strategy, check_strategy, strategy_mesh
from hp.parallel.compiled import compile_blocks, compile_loss
from hp.parallel.data_parallel import reduce_gradients
from hp.parallel.pipeline import Pipeline, PipelineError, pipeline
from hp.offload import OffloadError, offload
from hp.mpmd import MpmdError, mpmd
from hp.parallel.finetune import Lora, LoraError
from hp.parallel.lora import add_lora

__all__ = [
    "Layout", "LayoutError", "Lora", "LoraError", "MeshError", "ModelPlan", "MpmdError", "OffloadError", "Pipeline", "PipelineError", "PlanError", "RuleError", "Rules", "Strategy", "StrategyError",
    "StrictError", "add_lora", "apply_strategy", "check_strategy", "comm", "compile_blocks", "compile_loss", "constrain", "context_parallel", "describe", "explain", "from_local",
    "layout", "layout_of", "mesh", "mpmd", "offload", "parallelize", "pipeline", "reduce_gradients", "region", "rule", "rules", "run_replicated", "shard", "simulated",
    "strategy_mesh", "strict",
]

from hp import comm  # noqa: E402  (hp.comm.trace())
from hp.parallel import tp_plan  # noqa: E402  (hp.tp_plan.choose())

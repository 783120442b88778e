"""How long one rank's training step takes on a device, from the ops and collectives of the step hp train runs.

Why: whether a strategy is fast is the second question a user asks `hp plan`,
and the answer depends on every op the step runs on rank 0, not only on the
model's FLOPs: tp adds collectives and cuts each matmul, recompute runs the
forward twice, a vocabulary-parallel loss moves logits, and on a small model
the time goes to launching ops rather than to their arithmetic.

So the step is traced as the memory is (`hp.plan.step.fake_step`: hp
train's step on fake tensors, the model laid out on a fake world of the
target size), and every kernel it would run is counted with its FLOPs and
the bytes it reads and writes (`hp.plan.kernels`), beside each collective
`hp.comm.trace` sees (its kind, its ring bytes per rank, its group). The
time of that work on a `DeviceProfile`:

- a kernel takes the longer of its arithmetic (FLOPs over the peak rate of its
  dtype) and its memory traffic (bytes over the memory bandwidth): a roofline;
- each op costs the host its dispatch (`op_overhead`), each op on DTensors its
  sharding decision and wrapping (`dtensor_overhead`): on a CPU they add to the
  arithmetic (one thread does both); an accelerator's host launches ahead, so
  the step takes the longer of the two;
- a collective takes alpha-beta on its link (`DeviceProfile.collective_seconds`:
  its latency per ring step, its bytes over the bandwidth), over the
  inter-node link when its group spans nodes. Collectives do not overlap
  compute here (gloo and DTensor's eager collectives wait; FSDP's prefetch
  on an accelerator would hide some: the prediction is then an upper bound).

The `cpu` profile measures each rate on this machine
(`hp.plan.devices.measure_cpu`), so that `benchmarks/plan.py` can set
predictions beside measured steps.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hp.comm import trace
from hp.plan.devices import DeviceProfile
from hp.plan.kernels import Kernel, counting
from hp.plan.step import Step, StepShape, fake_step, real_step
from hp.parallel.strategy import Strategy
from hp.train.finetuning import Finetuning
from hp.watch import Collective


@dataclass(frozen=True)
class StepWork:
    """What rank 0 does in one step: the kernels that move data, every op on local tensors (views too), its ops
    on DTensors, and its collectives with their groups' strides on the mesh (ranks apart), to tell which cross
    nodes."""

    kernels: tuple[Kernel, ...]
    ops: int
    dtensor_ops: int
    collectives: tuple[tuple[Collective, int], ...]

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds by part: the kernels' rooflines, the host's dispatch (ops and DTensors' sharding
    decisions), the collectives; `total` adds them on a CPU, and takes the longer of the first two on an
    accelerator, whose host launches ahead."""

    compute: float
    host: float
    communication: float
    total: float
    untimed: int = 0  # collectives over a link the profile has no figures for (the `cpu` one before it is measured)

    def to_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute, "host_s": self.host, "communication_s": self.communication,
                "total_s": self.total, "untimed_collectives": self.untimed}


def trace_work(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
               finetuning: Finetuning | None = None) -> StepWork:
    """Rank 0's kernels and collectives over one steady training step, traced on fake tensors.

    >>> from hp.models import tiny_config
    >>> work = trace_work(tiny_config("llama", layers=2), {"tp": 2}, StepShape(rows=4, tokens=32))
    >>> work.dtensor_ops > 0, {c.kind for c, _ in work.collectives} >= {"all_reduce"}
    (True, True)
    """
    with fake_step(hf_config, strategy, shape, finetuning) as step:
        return work_of(step)


def work_of(step: Step) -> StepWork:
    """`step` (made by `fake_step`) run once more, its kernels, ops and collectives counted."""
    with WorkCount(step) as counted:
        step.run()
    return counted.work


class WorkCount(contextlib.AbstractContextManager):
    """Whatever runs `step` inside it, counted as `work_of` counts it; `work` holds the count once it has exited (so
    that one run serves `hp.plan.memory.memory_of` too: `memory_of(step, inside=WorkCount(step))`)."""

    def __init__(self, step: Step) -> None:
        self.step, self.work = step, None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> WorkCount:
        self._seen = self._stack.enter_context(trace())
        self._counted = self._stack.enter_context(counting())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        strides = _strides(self.step.mesh)
        self.work = StepWork(tuple(self._counted.kernels), self._counted.ops, self._counted.dtensor_ops,
                             tuple((c, strides.get(c.axis, 1)) for c in self._seen.records))


def predict(work: StepWork, device: DeviceProfile) -> StepTime:
    """`work`'s seconds on `device` (the module docstring says how).

    >>> from hp.plan.devices import PROFILES
    >>> work = StepWork((Kernel(2e12, 0, "bf16"),), 1, 0, ())
    >>> round(predict(work, PROFILES["h100-80g"]).total * 1e3, 2)  # 2 TFLOP at 989 TFLOP/s
    2.02
    """
    compute = sum(max(k.flops / (device.attention_rate(k.dtype) if k.attention else device.peak(k.dtype)),
                      k.bytes / device.bandwidth(k.bytes, k.transcendental, k.dtype)) for k in work.kernels)
    host = work.ops * device.op_overhead + work.dtensor_ops * device.dtensor_overhead
    timed = [device.collective_seconds(c.kind, c.group_size, c.bytes, stride) for c, stride in work.collectives]
    communication = sum(t for t in timed if t is not None)
    busy = compute + host if device.host_is_device else max(compute, host)
    return StepTime(compute, host, communication, busy + communication, sum(t is None for t in timed))


def measure_seconds(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
                    finetuning: Finetuning | None = None, *, steps: int = 5, seed: int = 0) -> float:
    """`trace_work`'s step run for real (`hp.plan.step.real_step`): the median seconds of `steps` steps after two
    untimed ones, every rank starting each step together."""
    step = real_step(hf_config, strategy, shape, finetuning, seed=seed)
    step.run()
    distributed = torch.distributed.is_initialized()
    times = []
    for _ in range(steps):
        if distributed:
            torch.distributed.barrier()
        start = time.perf_counter()
        step.run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _strides(mesh) -> dict[str, int]:
    """Each mesh axis's stride in ranks: how far apart the ranks of one of its groups are."""
    sizes, strides, stride = list(mesh.mesh.shape), {}, 1
    for name, size in reversed(list(zip(mesh.mesh_dim_names or (), sizes))):
        strides[name] = stride
        stride *= size
    return strides

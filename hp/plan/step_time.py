"""How long one rank's training step takes on a device, from the ops and collectives of the step hp train runs.

Why: whether a strategy is fast is the second question a user asks `hp plan`,
and the answer depends on every op the step runs on rank 0, not only on the
model's FLOPs: tp adds collectives and cuts each matmul, recompute runs the
forward twice, a vocabulary-parallel loss moves logits, and on a small model
the time goes to launching ops rather than to their arithmetic.

So the step is traced as `hp.plan.memory` traces it (the model on the meta
device, laid out on a fake world of the target size, one step of hp train on
fake tensors), and every kernel it would run is counted with its FLOPs (torch's
own formulas: `torch.utils.flop_counter`) and the bytes it reads and writes,
beside each collective `hp.comm.trace` sees (its kind, its ring bytes per
rank, its group). The time of that work on a `DeviceProfile`:

- a kernel takes the longer of its arithmetic (FLOPs over the peak rate of its
  dtype) and its memory traffic (bytes over the memory bandwidth): a roofline;
- each kernel costs its launch (`op_overhead`), each op on DTensors its
  sharding decision and wrapping (`dtensor_overhead`): on a CPU they add to the
  arithmetic (one thread does both); on an accelerator the host launches ahead
  and a kernel takes at least its launch;
- a collective takes alpha-beta on its link (`Link`: its latency per ring step,
  its bytes over the bandwidth), over the inter-node link when its group spans
  nodes. Collectives do not overlap compute here (gloo and DTensor's eager
  collectives wait; FSDP's prefetch on an accelerator would hide some: the
  prediction is then an upper bound).

The `cpu` profile measures each rate on this machine (`hp.plan.devices.measure_cpu`), so that
`benchmarks/plan.py` can set predictions beside measured steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hp.comm import trace
from hp.plan.devices import DeviceProfile
from hp.plan.memory import StepShape, _as_a_real_step, _built, _laid_out, run_step, step_inputs
from hp.parallel.apply import strategy_mesh
from hp.parallel.strategy import Strategy
from hp.train.finetuning import Finetuning
from hp.watch import Collective

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# ring steps of a collective over p ranks: the latency paid p - 1 times (twice for an all-reduce)
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1, "scatter": 1}


@dataclass(frozen=True)
class Kernel:
    """One kernel a step runs: its FLOPs, the bytes it reads and writes, and the dtype its arithmetic is in."""

    flops: float
    bytes: int
    dtype: str
    transcendental: bool = False  # exp, log, softmax and their kin: slower per byte than a copy on a CPU
    attention: bool = False  # a fused attention kernel: its own FLOP/s (`DeviceProfile.attention_rate`)


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
    from torch._subclasses.fake_tensor import FakeTensorMode

    strategy = Strategy.of(strategy)
    mesh = strategy_mesh(strategy, simulate=True)
    with torch.device("meta"):
        model = _built(hf_config, finetuning)
    _laid_out(model, strategy, mesh)
    strides = _strides(mesh)
    with FakeTensorMode(allow_non_fake_inputs=True), _as_a_real_step():
        model.to_empty(device=mesh.device_type)
        inputs, optimizer = step_inputs(model, shape, mesh.device_type, fake=True)
        run_step(model, inputs, optimizer, shape, mesh.device_type, fake=True)  # the first makes AdamW's states
        with trace() as seen, counting() as counted:
            run_step(model, inputs, optimizer, shape, mesh.device_type, fake=True)
    return StepWork(tuple(counted.kernels), counted.ops, counted.dtensor_ops,
                    tuple((c, strides.get(c.axis, 1)) for c in seen.records))


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
    timed = [_collective_seconds(c, stride, device) for c, stride in work.collectives]
    communication = sum(t for t in timed if t is not None)
    busy = compute + host if device.host_is_device else max(compute, host)
    return StepTime(compute, host, communication, busy + communication, sum(t is None for t in timed))


def counting() -> _Counting:
    """A dispatch mode counting the kernels, the ops and the ops on DTensors run while it is entered (`.kernels`,
    `.ops`, `.dtensor_ops`); enter `hp.comm.trace()` before it, so that it sees DTensors' ops."""
    return _Counting()


def measure_seconds(hf_config, strategy: Strategy | Mapping[str, Any], shape: StepShape,
                    finetuning: Finetuning | None = None, *, steps: int = 5, seed: int = 0) -> float:
    """`trace_work`'s step run for real (as `hp.plan.memory.measure_step` runs it): the median seconds of `steps`
    steps after two untimed ones, every rank starting each step together."""
    strategy = Strategy.of(strategy)
    simulate = not torch.distributed.is_initialized() or torch.distributed.get_backend() == "fake"
    mesh = strategy_mesh(strategy, simulate=simulate)
    torch.manual_seed(seed)
    model = _laid_out(_built(hf_config, finetuning), strategy, mesh).to(mesh.device_type)
    inputs, optimizer = step_inputs(model, shape, mesh.device_type)
    times = []
    for step in range(steps + 2):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start = time.perf_counter()
        run_step(model, inputs, optimizer, shape, mesh.device_type)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective_seconds(collective: Collective, stride: int, device: DeviceProfile) -> float | None:
    """Alpha-beta on the collective's link (None where the profile has no figures for it)."""
    p = collective.group_size
    if p <= 1:
        return 0.0
    link = device.inter_node if stride * p > device.devices_per_node else device.intra_node
    if link is None:
        return None
    steps = _STEPS.get(collective.kind, 1) * (p - 1) if collective.kind != "send_recv" else 1
    return steps * link.latency + collective.bytes / link.bandwidth


def _strides(mesh) -> dict[str, int]:
    """Each mesh axis's stride in ranks: how far apart the ranks of one of its groups are."""
    sizes, strides, stride = list(mesh.mesh.shape), {}, 1
    for name, size in reversed(list(zip(mesh.mesh_dim_names or (), sizes))):
        strides[name] = stride
        stride *= size
    return strides


class _Counting(TorchDispatchMode):
    """Every kernel a step runs on local tensors (DTensors' ops counted, then left to DTensor to run as kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []
        self.ops = self.dtensor_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops += 1
            return NotImplemented  # DTensor runs it as kernels on its local tensors, which come back here
        out = func(*args, **kwargs)
        if func.namespace in ("prim", "profiler"):  # a tensor's device read, a profiler's mark: seen under a mode only
            return out
        self.ops += 1
        if not _moves_no_data(func, out):
            self.kernels.append(_kernel(func, args, kwargs, out))
        return out


def _moves_no_data(func, out) -> bool:
    schema = func._schema
    aliases = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    writes = schema.is_mutable or any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
    return aliases or not writes or func.namespace in ("_c10d_functional", "c10d", "_dtensor") or func in _FREE


_aten = torch.ops.aten
# allocations that write nothing, and a view torch does not mark as one
_FREE = {_aten.detach.default, _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
         _aten._unsafe_view.default}
# the CPU's attention kernels count as the accelerators' do (torch registers formulas for those only)
_FLOPS = {_aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
          _aten._scaled_dot_product_flash_attention_for_cpu_backward:
              flop_registry[_aten._scaled_dot_product_flash_attention_backward]}
_ATTENTION = {_aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention_for_cpu_backward,
              _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_flash_attention_backward,
              _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_efficient_attention_backward,
              _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_cudnn_attention_backward}
_TRANSCENDENTAL = {getattr(_aten, name) for name in (
    "exp", "log", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "silu",
    "silu_backward", "gelu", "gelu_backward", "sigmoid", "sigmoid_backward", "tanh", "tanh_backward", "rsqrt", "pow",
    "erf", "sin", "cos", "_fused_adamw_", "_foreach_sqrt", "sqrt", "div")}


def _kernel(func, args, kwargs, out) -> Kernel:
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    counter = _FLOPS.get(func.overloadpacket) or flop_registry.get(func.overloadpacket)
    flops = float(counter(*args, **kwargs, out_val=out)) if counter is not None else 0.0
    moved = sum(t.numel() * t.element_size() for t in tensors)
    floating = [t.dtype for t in tensors if t.dtype in _DTYPES]
    return Kernel(flops, moved, _DTYPES[floating[0]] if floating else "fp32", func.overloadpacket in _TRANSCENDENTAL,
                  func.overloadpacket in _ATTENTION)

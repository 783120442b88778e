"""What a step runs, kernel by kernel: the dispatch mode that counts a step's ops, and what each kernel costs.

`hp.plan.step_time` predicts a step's time from its kernels (FLOPs and bytes
moved), its ops (each one the host dispatches) and its ops on DTensors; the
`cpu` profile (`hp.plan.devices.measure_cpu`) measures its rates with the
same count, so that a prediction and a profile speak of the same ops. A
kernel's FLOPs are torch's own formulas (`torch.utils.flop_counter`), the
CPU's attention kernels counted as the accelerators' are; its bytes are
every tensor it reads and writes; views, allocations that write nothing,
and collectives (timed as collectives) move no data here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Kernel:
    """One kernel a step runs: its FLOPs, the bytes it reads and writes, and the dtype its arithmetic is in."""

    flops: float
    bytes: int
    dtype: str
    transcendental: bool = False  # exp, log, softmax and their kin: slower per byte than a copy on a CPU
    attention: bool = False  # a fused attention kernel: its own FLOP/s (`DeviceProfile.attention_rate`)


def counting() -> Counting:
    """A dispatch mode counting the kernels, the ops and the ops on DTensors run while it is entered (`.kernels`,
    `.ops`, `.dtensor_ops`); enter `hp.comm.trace()` before it, so that it sees DTensors' ops.

    >>> with counting() as counted:
    ...     _ = torch.ones(4, 8) @ torch.ones(8, 2)
    >>> counted.ops, counted.kernels[-1].flops
    (3, 128.0)
    """
    return Counting()


class Counting(TorchDispatchMode):
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
    floating = [t.dtype for t in tensors if t.dtype in DTYPES]
    return Kernel(flops, moved, DTYPES[floating[0]] if floating else "fp32", func.overloadpacket in _TRANSCENDENTAL,
                  func.overloadpacket in _ATTENTION)

"""Which device this process computes on, and which collective backend goes with it.

One place decides cuda/nccl, npu/hccl or cpu/gloo so that the same program
runs on NVIDIA GPUs, Ascend NPUs and CPUs. `torch_npu` is optional: it is
imported only when installed, which registers the `npu` accelerator.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Device:
    """A device type and the process-group backend for its collectives.

    >>> from hp.device import detect
    >>> detect().type in ("cpu", "cuda", "npu")
    True
    """

    type: str
    backend: str

    @property
    def pg_backend(self) -> str:
        """Backend string for `init_process_group`: CPU collectives always go over gloo."""
        if self.type == "cpu":
            return "gloo"
        return f"cpu:gloo,{self.type}:{self.backend}"


def _import_npu_if_present() -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers the npu device and hccl)


def available() -> str:
    """The accelerator type this machine offers (after importing torch_npu if present), "cpu" when none."""
    _import_npu_if_present()
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


def detect() -> Device:
    """The accelerator torch sees (after importing torch_npu if present), else CPU.

    `HP_DEVICE=cpu` (or `cuda`, `npu`) overrides the choice, e.g. to run on CPU on a GPU machine.
    """
    kind = os.environ.get("HP_DEVICE", "auto")
    if kind == "auto":
        kind = available()
    elif kind != "cpu":
        _import_npu_if_present()
    backend = dist.Backend.default_device_backend_map.get(kind)
    if backend is None:
        raise RuntimeError(f"no collective backend is registered for device type '{kind}'")
    return Device(kind, backend)


def bind_local_device(device: Device) -> None:
    """Pin this worker to its own accelerator (LOCAL_RANK), as torchrun expects."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))

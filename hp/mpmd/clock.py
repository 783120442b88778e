"""Timing work on an accelerator: its kernels are queued and the call returns at once.

A clock read right after a forward on a GPU or an NPU times its launch,
not its work. The cost table (`hp.mpmd.measure`) and the placement probes
(`hp.mpmd.choice`) time actions, so each waits for the device's queue
before it reads the clock; on the CPU there is nothing to wait for. Only
the steps that are measured wait: a plan, once made, runs unsynchronized.

>>> settle("cpu")  # nothing queued on the CPU
"""

from __future__ import annotations

import torch


def settle(device: torch.device | str) -> None:
    """Wait until `device` has run the work queued on it (no wait on the CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)

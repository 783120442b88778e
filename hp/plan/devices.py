"""The accelerators `hp plan` plans for: a named profile's memory, peak rates and links.

Whether a rank's bytes fit, and later how long a step takes, depend on the
device: its memory, its peak FLOP/s per dtype, and the links between devices
within a node and across nodes. The named profiles carry the vendors'
published figures for one device (dense math, no sparsity; a link's
bandwidth one way, per device); `cpu` is this machine, measured when asked
for (`measure_cpu`: its memory from /proc/meminfo, its FLOP/s from a matmul
on its threads). A user whose part differs spells its figures out in the
config's `cluster.device` (`spelled_out`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024**2
GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link between two devices: bytes/s one way, and the latency of one message in seconds."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class DeviceProfile:
    """One device: its memory in bytes, peak FLOP/s per dtype, its links, and how many share a node.

    >>> PROFILES["h100-80g"].memory_bytes / 1024**3, PROFILES["h100-80g"].peak("bf16") / 1e12
    (79.6474609375, 989.0)
    """

    name: str
    memory_bytes: int
    flops: tuple[tuple[str, float], ...]  # (dtype, peak FLOP/s), the dtypes whose figure is known
    intra_node: Link | None  # None: not measured
    inter_node: Link | None
    devices_per_node: int = 8

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` ('bf16', 'fp16', 'fp32')."""
        rates = dict(self.flops)
        if dtype not in rates:
            raise ValueError(f"device {self.name!r} has no peak FLOP/s for {dtype} (it has {', '.join(rates)})")
        return rates[dtype]


# Memory as the driver reports it (nvidia-smi's MiB); links one way per device: NVLink 4 at 900 GB/s both ways,
# NVLink 3 at 600, HCCS at 392; across nodes one 400 Gb/s (NDR) or 200 Gb/s (HDR, RoCE) NIC per device.
PROFILES: dict[str, DeviceProfile] = {
    "h100-80g": DeviceProfile("h100-80g", 81559 * MIB, (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
                              Link(450 * GB, 5e-6), Link(50 * GB, 10e-6)),
    "h200-141g": DeviceProfile("h200-141g", 143771 * MIB, (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
                               Link(450 * GB, 5e-6), Link(50 * GB, 10e-6)),
    "a100-80g": DeviceProfile("a100-80g", 81920 * MIB, (("bf16", 312e12), ("fp16", 312e12), ("fp32", 19.5e12)),
                              Link(300 * GB, 5e-6), Link(25 * GB, 10e-6)),
    # the 910B3's commonly cited 313 TFLOPS at fp16; its fp32 rate is not published alongside
    "910b-64g": DeviceProfile("910b-64g", 65536 * MIB, (("bf16", 313e12), ("fp16", 313e12)),
                              Link(196 * GB, 10e-6), Link(25 * GB, 15e-6)),
}
KNOWN = (*PROFILES, "cpu")


def profile(name: str) -> DeviceProfile:
    """The profile named `name`; `cpu` is measured here.

    >>> profile("a100-80g").peak("bf16")
    312000000000000.0
    >>> profile("v100")
    Traceback (most recent call last):
    ...
    ValueError: device 'v100' has no profile: expected one of h100-80g, h200-141g, a100-80g, 910b-64g, cpu
    """
    if name == "cpu":
        return measure_cpu()
    if name not in PROFILES:
        raise ValueError(f"device {name!r} has no profile: expected one of {', '.join(KNOWN)}")
    return PROFILES[name]


def spelled_out(figures: Mapping[str, Any]) -> DeviceProfile:
    """The profile of a device given by its figures (a config's `cluster.device` mapping, checked there):
    memory in GiB, peak TFLOP/s per dtype, links in GB/s one way and microseconds.

    >>> d = spelled_out({"name": "b200", "memory_gib": 180, "tflops": {"bf16": 2250},
    ...                  "intra_node": {"bandwidth_gb_s": 900, "latency_us": 5}})
    >>> d.memory_bytes / 1024**3, d.peak("bf16") / 1e12, d.intra_node.bandwidth / 1e9, d.inter_node
    (180.0, 2250.0, 900.0, None)
    """
    links = {key: Link(value["bandwidth_gb_s"] * GB, value["latency_us"] * 1e-6)
             for key in ("intra_node", "inter_node") if (value := figures.get(key)) is not None}
    return DeviceProfile(figures.get("name", "custom"), round(figures["memory_gib"] * 1024**3),
                         tuple((dtype, tflops * 1e12) for dtype, tflops in figures["tflops"].items()),
                         links.get("intra_node"), links.get("inter_node"))


def check_nodes(devices: int, per_node: int | None, given_as: str | None = None) -> None:
    """`devices` must fill whole nodes of `per_node` (None: one node); `given_as` names where the user gave it
    (default: the flag, `--devices-per-node N`).

    >>> check_nodes(16, 8); check_nodes(12, 8)
    Traceback (most recent call last):
    ...
    ValueError: --devices-per-node 8: 12 devices do not fill whole nodes of 8
    """
    if per_node is not None and (per_node < 1 or devices % per_node):
        given_as = given_as or f"--devices-per-node {per_node}"
        raise ValueError(f"{given_as}: {devices} devices do not fill whole nodes of {per_node}")


def measure_cpu(size: int = 1024) -> DeviceProfile:
    """This machine as a device: its memory, and the fp32 and bf16 FLOP/s of a `size`-square matmul on torch's
    threads (the best of three). No fp16 figure (CPU kernels for it are a fallback, seconds per matmul), and its
    links (gloo over loopback) are not measured yet."""
    import torch

    flops = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        a = torch.randn(size, size, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
        flops.append((name, 2 * size**3 / best))
    memory = _meminfo_bytes()
    return DeviceProfile("cpu", memory, tuple(flops), None, None, devices_per_node=os.cpu_count() or 1)


def _meminfo_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

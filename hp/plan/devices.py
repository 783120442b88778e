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

import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024**2
GIB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link between two devices: bytes/s one way, and the latency of one message in seconds; `kinds` holds the
    figures measured for particular collectives where they differ (gloo moves an all-gather's bytes slower than an
    all-reduce's).

    >>> link = Link(1e9, 1e-5, (("all_gather", 4e8, 2e-5),))
    >>> link.of("all_gather").bandwidth, link.of("all_reduce").bandwidth
    (400000000.0, 1000000000.0)
    """

    bandwidth: float
    latency: float
    kinds: tuple[tuple[str, float, float], ...] = ()  # (collective, bandwidth, latency)

    def of(self, kind: str) -> Link:
        """The link's figures for collective `kind`."""
        for name, bandwidth, latency in self.kinds:
            if name == kind:
                return Link(bandwidth, latency)
        return self


@dataclass(frozen=True)
class DeviceProfile:
    """One device: its memory in bytes, peak FLOP/s per dtype, memory bandwidth, its links, how many share a node,
    and what the host spends per op (`hp.plan.step_time` says how each figure enters a step's time).

    >>> PROFILES["h100-80g"].memory_bytes / 1024**3, PROFILES["h100-80g"].peak("bf16") / 1e12
    (79.6474609375, 989.0)
    """

    name: str
    memory_bytes: int
    flops: tuple[tuple[str, float], ...]  # (dtype, peak FLOP/s), the dtypes whose figure is known
    intra_node: Link | None  # None: not measured
    inter_node: Link | None
    devices_per_node: int = 8
    memory_bandwidth: float = 0.0  # bytes/s; 0: unknown (a kernel's traffic then costs nothing)
    # measured here (a CPU's caches make it depend on the size, and bf16 is converted): (dtype, bytes a kernel
    # moves, bytes/s of a plain elementwise kernel, of a transcendental one), by size
    traffic: tuple[tuple[str, int, float, float], ...] = ()
    attention: tuple[tuple[str, float], ...] = ()  # FLOP/s of the attention kernels per dtype, where measured
    op_overhead: float = 5e-6  # the host's seconds per eager op: dispatch, autograd, the launch
    dtensor_overhead: float = 30e-6  # the host's seconds per op on DTensors: the cached sharding decision, wrapping
    host_is_device: bool = False  # a CPU: the host's time adds to the arithmetic; an accelerator runs behind its host
    backend: str = "nccl"  # the collectives' library, whose own buffers `hp.plan.memory` adds to a traced step

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` ('bf16', 'fp16', 'fp32')."""
        rates = dict(self.flops)
        if dtype not in rates:
            raise ValueError(f"device {self.name!r} has no peak FLOP/s for {dtype} (it has {', '.join(rates)})")
        return rates[dtype]

    def collective_seconds(self, kind: str, group_size: int, sent: int, stride: int = 1) -> float | None:
        """Alpha-beta for a collective of `kind` over `group_size` ranks `stride` apart, each sending `sent` bytes
        (`hp.cost.ring_bytes`): its ring steps of latency ((p - 1), twice for an all-reduce; one for a send) and its
        bytes over the bandwidth, on the inter-node link once the group spans more than a node; None where the
        profile has no figures for that link.

        >>> PROFILES["h100-80g"].collective_seconds("all_reduce", 8, 450 * 10**9)  # 14 steps of 5 us, then 1 s
        1.00007
        """
        if group_size <= 1:
            return 0.0
        link = self.inter_node if stride * group_size > self.devices_per_node else self.intra_node
        if link is None:
            return None
        link = link.of(kind)
        steps = 1 if kind == "send_recv" else (2 if kind == "all_reduce" else 1) * (group_size - 1)
        return steps * link.latency + sent / link.bandwidth

    def attention_rate(self, dtype: str) -> float:
        """FLOP/s of an attention kernel in `dtype`: measured (a CPU's lag its matmuls), else the peak."""
        return dict(self.attention).get(dtype) or self.peak(dtype)

    def bandwidth(self, moved: int, transcendental: bool = False, dtype: str = "fp32") -> float:
        """Bytes/s of a kernel in `dtype` that moves `moved` bytes: the measured point of the largest size not above
        it (fp32's where `dtype` was not measured), or the flat `memory_bandwidth`.

        >>> d = DeviceProfile("d", 1, (), None, None, traffic=(("fp32", 1 << 20, 40e9, 20e9), ("fp32", 1 << 26, 5e9, 3e9)))
        >>> d.bandwidth(1 << 10), d.bandwidth(1 << 22, transcendental=True), d.bandwidth(1 << 27, dtype="bf16")
        (40000000000.0, 20000000000.0, 5000000000.0)
        """
        points = [p for p in self.traffic if p[0] == dtype] or [p for p in self.traffic if p[0] == "fp32"]
        if not points:
            return self.memory_bandwidth or float("inf")
        below = [p for p in points if p[1] <= moved] or points[:1]
        return below[-1][3 if transcendental else 2]


# Memory as the driver reports it (nvidia-smi's MiB); HBM bandwidth as the vendors publish it (H100 SXM 3.35 TB/s,
# H200 4.8, A100 80 GB SXM 2.039, the 910B's commonly cited 1.6); links one way per device: NVLink 4 at 900 GB/s
# both ways, NVLink 3 at 600, HCCS at 392; across nodes one 400 Gb/s (NDR) or 200 Gb/s (HDR, RoCE) NIC per device.
PROFILES: dict[str, DeviceProfile] = {
    "h100-80g": DeviceProfile("h100-80g", 81559 * MIB, (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
                              Link(450 * GB, 5e-6), Link(50 * GB, 10e-6), memory_bandwidth=3350 * GB),
    "h200-141g": DeviceProfile("h200-141g", 143771 * MIB, (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
                               Link(450 * GB, 5e-6), Link(50 * GB, 10e-6), memory_bandwidth=4800 * GB),
    "a100-80g": DeviceProfile("a100-80g", 81920 * MIB, (("bf16", 312e12), ("fp16", 312e12), ("fp32", 19.5e12)),
                              Link(300 * GB, 5e-6), Link(25 * GB, 10e-6), memory_bandwidth=2039 * GB),
    # the 910B3's commonly cited 313 TFLOPS at fp16; its fp32 rate is not published alongside
    "910b-64g": DeviceProfile("910b-64g", 65536 * MIB, (("bf16", 313e12), ("fp16", 313e12)),
                              Link(196 * GB, 10e-6), Link(25 * GB, 15e-6), memory_bandwidth=1600 * GB, backend="hccl"),
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
        return _this_cpu()
    if name not in PROFILES:
        raise ValueError(f"device {name!r} has no profile: expected one of {', '.join(KNOWN)}")
    return PROFILES[name]


# The accelerators a machine may hold, by a piece of the name their driver reports, and their profiles.
_BY_NAME = (("H100", "h100-80g"), ("H200", "h200-141g"), ("A100-SXM4-80GB", "a100-80g"), ("A100 80GB", "a100-80g"),
            ("910B", "910b-64g"))


def local_profile(kind: str, ranks: int) -> DeviceProfile:
    """The device this machine trains on (`kind`: cuda, npu or cpu, as `hp.device.available` says): an
    accelerator's named profile, matched by the name its driver reports (`driver_named`); a CPU measured
    (`measure_cpu`) on `ranks` gloo processes forked here (at most one per core), each on a core of its own with
    one thread as hp train's workers run, the link between them measured by them: about 10 s.

    >>> # what hp train's parallel: auto does on this machine, with 2 workers:
    >>> # local_profile(hp.device.available(), 2).name  ->  'cpu' here, 'h100-80g' on an H100
    """
    if kind == "cpu":
        return _measured_on_processes(max(1, min(ranks, os.cpu_count() or 1)))
    import torch

    return driver_named(getattr(torch, kind).get_device_name(0))


@functools.cache
def _this_cpu() -> DeviceProfile:
    """This machine, measured once a process (`measure_cpu`): every plan it makes prices on the same figures."""
    return measure_cpu()


def driver_named(name: str) -> DeviceProfile:
    """The profile of the accelerator whose driver reports `name`.

    >>> driver_named("NVIDIA H100 80GB HBM3").name
    'h100-80g'
    >>> driver_named("Tesla V100-SXM2-32GB")
    Traceback (most recent call last):
    ...
    ValueError: this machine's device 'Tesla V100-SXM2-32GB' has no profile in hp (it knows h100-80g, h200-141g, a100-80g, 910b-64g): give its figures as cluster.device
    """
    for piece, profile_name in _BY_NAME:
        if piece in name:
            return PROFILES[profile_name]
    raise ValueError(f"this machine's device {name!r} has no profile in hp (it knows {', '.join(PROFILES)}): "
                     "give its figures as cluster.device")


def _measured_on_processes(ranks: int) -> DeviceProfile:
    """`measure_cpu` on `ranks` processes forked here, over gloo (the link's figures need two): rank 0's profile.
    Forked, so that pinning a core and a thread count leaves this process as it was."""
    import tempfile

    from hp.plan.forked import forked

    with tempfile.TemporaryDirectory(prefix="hp-measure-") as store:
        return forked(_measure_rank, os.path.join(store, "rendezvous"), ranks=ranks, what="measuring this CPU")


def _measure_rank(rank: int, ranks: int, store: str) -> DeviceProfile:
    """One measuring process: pinned to core `rank` with one thread, `measure_cpu` with the link to its peers."""
    import torch
    import torch.distributed as dist

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    if ranks == 1:
        return measure_cpu()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    try:
        return measure_cpu(link=measure_link())
    finally:
        dist.destroy_process_group()


def device_of(value: str | Mapping[str, Any]) -> DeviceProfile:
    """A config's `cluster.device` or `--device`: a profile's name (`profile`), or its figures (`spelled_out`).

    >>> device_of("h100-80g").name, device_of({"memory_gib": 1, "tflops": {"fp32": 1}}).name
    ('h100-80g', 'custom')
    """
    return profile(value) if isinstance(value, str) else spelled_out(value)


def spelled_out(figures: Mapping[str, Any]) -> DeviceProfile:
    """The profile of a device given by its figures (a config's `cluster.device` mapping, checked there):
    memory in GiB, peak TFLOP/s per dtype, the memory's bandwidth and links in GB/s one way, latencies in
    microseconds.

    >>> d = spelled_out({"name": "b200", "memory_gib": 180, "tflops": {"bf16": 2250}, "memory_bandwidth_gb_s": 8000,
    ...                  "intra_node": {"bandwidth_gb_s": 900, "latency_us": 5}})
    >>> d.memory_bytes / 1024**3, d.peak("bf16") / 1e12, d.memory_bandwidth / 1e9, d.intra_node.bandwidth / 1e9
    (180.0, 2250.0, 8000.0, 900.0)
    """
    links = {key: Link(value["bandwidth_gb_s"] * GB, value["latency_us"] * 1e-6)
             for key in ("intra_node", "inter_node") if (value := figures.get(key)) is not None}
    return DeviceProfile(figures.get("name", "custom"), round(figures["memory_gib"] * GIB),
                         tuple((dtype, tflops * 1e12) for dtype, tflops in figures["tflops"].items()),
                         links.get("intra_node"), links.get("inter_node"),
                         memory_bandwidth=figures.get("memory_bandwidth_gb_s", 0.0) * GB)


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


def measure_cpu(size: int = 1024, link: Link | None = None) -> DeviceProfile:
    """This machine as a device, on torch's threads: its memory, the FLOP/s of a linear layer's matmuls on `size`
    tokens and of attention, the bandwidth of elementwise kernels by the bytes they move (`_traffic`), in fp32
    and bf16 (`_measured_dtypes`), and the host's seconds per op of a training step whose arithmetic is nil and
    per op on DTensors (the best of a few runs each). `link`: gloo's between two processes here, measured by
    those processes (`measure_link`); None leaves the links unknown. In a process group every rank calls it (its
    DTensor figure is taken on a mesh over the world)."""
    flops = [(name, _linear_flops(dtype, size)) for dtype, name in _measured_dtypes()]
    op_seconds = _op_seconds()
    return DeviceProfile("cpu", _meminfo_bytes(), tuple(flops), link, link, devices_per_node=os.cpu_count() or 1,
                         traffic=_traffic(), attention=_attention_flops(), op_overhead=op_seconds,
                         dtensor_overhead=_dtensor_op_seconds(op_seconds, link), host_is_device=True, backend="gloo")


def _measured_dtypes() -> list[tuple[Any, str]]:
    """The dtypes a CPU is measured in, with their names (fp16's CPU kernels are a fallback, seconds a matmul)."""
    import torch

    from hp.plan.kernels import DTYPES

    return [(dtype, DTYPES[dtype]) for dtype in (torch.float32, torch.bfloat16)]


def _linear_flops(dtype, size: int) -> float:
    """FLOP/s of a linear layer's three matmuls (forward, and the two of backward, with their transposed operands)
    on `size` tokens of `size // 2` features to `size` (the best of three)."""
    import torch

    x, w, g = (torch.randn(*shape, dtype=dtype) for shape in ((size, size // 2), (size, size // 2), (size, size)))
    seconds = _best(lambda: (x @ w.t(), g @ w, g.t() @ x))
    return 3 * 2 * size * size * (size // 2) / seconds


def _attention_flops() -> tuple[tuple[str, float], ...]:
    """FLOP/s of causal attention's forward and backward kernels together, in fp32 and bf16, on 4 sequences of 128
    tokens, 8 heads of 32 features (FLOPs as `hp.plan.step_time` counts them)."""
    import torch

    from hp.plan.kernels import counting

    rates = []
    for dtype, name in _measured_dtypes():
        q, k, v = (torch.randn(4, 8, 128, 32, dtype=dtype, requires_grad=True) for _ in range(3))

        def run() -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        run()
        with counting() as counted:
            run()
        rates.append((name, sum(k.flops for k in counted.kernels if k.attention) / _best(run)))
    return tuple(rates)


def _traffic() -> tuple[tuple[str, int, float, float], ...]:
    """(dtype, bytes moved, bytes/s of `x * y`, of `exp(x)`) in fp32 and bf16 for tensors of 64K to 16M elements,
    the output written anew as a step's activations are. Each rate is the mean of the kernel's time with its inputs
    in cache (as written by the kernel just before) and evicted (as backward reads what forward saved)."""
    import torch

    evict = torch.empty(16 << 20)  # 64 MiB, more than the caches hold
    points = []
    for dtype, name in _measured_dtypes():
        for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24):
            x, y = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
            kernels = (lambda: x * y, lambda: x.exp())
            cached = [_best(run, repeat=5) for run in kernels]
            evicted = [_best(run, repeat=5, sync=lambda: evict.fill_(1.0)) for run in kernels]
            plain, curved = ((a + b) / 2 for a, b in zip(cached, evicted))
            points.append((name, 3 * x.nbytes, 3 * x.nbytes / plain, 2 * x.nbytes / curved))
    return tuple(points)


def measure_link(group=None, sizes: tuple[int, int] = (1 << 10, 1 << 25)) -> Link:
    """The latency and bandwidth of the process group's link (every rank calls it), from collectives of two sizes
    (the best of five each) read as `hp.plan.step_time` reads them: ring steps of latency, and the bytes a rank
    sends (`hp.cost.ring_bytes`) over the bandwidth. The all-reduce's figures are the link's; the all-gather's, the
    all-to-all's and the reduce-scatter's its `kinds`. The larger size is FSDP's scale (a block's gradients, tens
    of MB): gloo moves such a message 2-3 times slower per byte than one of 4 MB."""
    import torch
    import torch.distributed as dist

    from hp.cost import ring_bytes

    p = dist.get_world_size(group)
    # torch 2.13's names (FSDP's reduce-scatter is the second), else the older ones
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce(n: int):
        t = torch.ones(n // 4)
        return n, lambda: dist.all_reduce(t, group=group)

    def all_gather(n: int):
        t, out = torch.ones(n // 4 // p), torch.empty(n // 4)
        return n, lambda: all_gather_single(out, t, group=group)

    def all_to_all(n: int):
        t, out = torch.ones(n // 4), torch.empty(n // 4)
        return n, lambda: dist.all_to_all_single(out, t, group=group)

    def reduce_scatter(n: int):  # as FSDP reduces its gradients
        t, out = torch.ones(n // 4), torch.empty(n // 4 // p)
        return n, lambda: reduce_scatter_single(out, t, group=group)

    fitted = []
    for kind, make, steps in (("all_reduce", all_reduce, 2 * (p - 1)), ("all_gather", all_gather, p - 1),
                              ("all_to_all", all_to_all, p - 1), ("reduce_scatter", reduce_scatter, p - 1)):
        sent, seconds = [], []
        for n in sizes:
            payload, run = make(n)
            run()
            seconds.append(_best(run, repeat=5, sync=lambda: dist.barrier(group)))
            sent.append(ring_bytes(kind, payload, p))
        bandwidth = (sent[1] - sent[0]) / max(seconds[1] - seconds[0], 1e-9)
        fitted.append((kind, bandwidth, max(seconds[0] - sent[0] / bandwidth, 0.0) / steps))
    return Link(fitted[0][1], fitted[0][2], tuple(fitted[1:]))


def _best(run, repeat: int = 3, sync=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        if sync is not None:
            sync()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _op_seconds() -> float:
    """The host's seconds per op of a training step whose arithmetic is nil: a Llama of 16 features on 8 tokens
    (HF's modeling code, autograd, the loss, AdamW), its ops counted as `hp.plan.step_time` counts a step's."""
    import torch

    from hp.models import tiny_config
    from hp.plan.kernels import counting
    from hp.train.model import model_class

    config = tiny_config("llama", layers=2, vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = model_class(config).from_config(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (1, 8))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with counting() as counted:
        step()
    return _best(step, repeat=10) / counted.ops


def _dtensor_op_seconds(op_seconds: float, link: Link | None) -> float:
    """The host's seconds per op on DTensors beyond its kernels: a Llama of 16 features laid out with tp over two
    ranks (the process group's, or a fake world's whose collectives move nothing) on 8 tokens, its step's seconds
    less its ops' (`op_seconds` each) and its collectives' (alpha-beta on `link`), per op on DTensors."""
    import torch.distributed as dist

    import hp
    from hp.models import tiny_config
    from hp.plan.kernels import counting
    from hp.plan.step import StepShape, real_step

    real = dist.is_initialized() and dist.get_backend() != "fake"
    tp = dist.get_world_size() if real else 2
    config = tiny_config("llama", layers=2, vocab_size=64 * tp, hidden_size=8 * tp, intermediate_size=16 * tp,
                         num_attention_heads=tp, num_key_value_heads=tp, head_dim=8)
    step = real_step(config, {"tp": tp}, StepShape(rows=2, tokens=8))
    with hp.comm.trace() as seen, counting() as counted:
        step.run()
    profile = DeviceProfile("link", 0, (), link, link, devices_per_node=tp)
    collectives = sum(profile.collective_seconds(c.kind, c.group_size, c.bytes) or 0.0 for c in seen.records) \
        if real else 0.0
    seconds = _best(step.run, repeat=5, sync=dist.barrier if real else None)
    return max(seconds - counted.ops * op_seconds - collectives, 0.0) / max(counted.dtensor_ops, 1)


def _meminfo_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""The cost table of a running MPMD step: every rank's timings gathered, every transfer priced by the link.

The runtime times each action it runs and counts each tensor's bytes it
sends (`hp.mpmd.runtime.Runtime.samples`, `.transfers`). After the first
steps, `gathered_costs` collects them from every rank (a collective: every
rank calls it) into one `Costs`: the median of each stage's forward and
backward, and each flow's bytes priced as `latency + bytes / bandwidth` of
the link `link` measured between two ranks (a ping-pong, so neither rank's
compute is counted). Every rank then plans from the same table, so every
rank computes the same plan.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from hp.mpmd.costs import Costs
from hp.mpmd.runtime import Runtime


def link(group=None, *, nbytes: int = 1 << 20, rounds: int = 5, device: torch.device | str = "cpu") -> tuple[float, float]:
    """(latency in seconds, bandwidth in bytes per second) between the group's ranks 0 and 1, the medians of
    `rounds` ping-pongs of 4 bytes and of `nbytes`; the same on every rank (rank 0's, broadcast)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    measured = torch.zeros(2, dtype=torch.float64, device=device)
    if world > 1 and rank < 2:
        peer = dist.get_global_rank(group, 1 - rank) if group is not None else 1 - rank
        small = _round_trip(torch.zeros(1, device=device), peer, rank, rounds, group)
        large = _round_trip(torch.zeros(nbytes // 4, device=device), peer, rank, rounds, group)
        measured[0], measured[1] = small / 2, nbytes / max((large - small) / 2, 1e-9)
    dist.broadcast(measured, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(measured[0]), float(measured[1])


def _round_trip(buffer: torch.Tensor, peer: int, rank: int, rounds: int, group) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gathered_costs(runtime: Runtime, latency: float, bandwidth: float, group=None) -> Costs:
    """The cost table of what every rank's `runtime` measured so far (every rank calls it)."""
    mine = (runtime.samples, runtime.transfers)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    samples = [s for theirs, _ in everyone for s in theirs]
    transfers = [(src, dst, latency + nbytes / bandwidth) for _, theirs in everyone for src, dst, nbytes in theirs]
    return Costs.measured(samples, transfers)

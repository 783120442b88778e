"""Communication cost model: bytes one rank sends, per collective kind and mesh axis.

One place holds the arithmetic that `hp.comm.trace()` measures and the
tensor-parallel planner minimises, so that a plan's predicted bytes and a
run's counted bytes can be compared exactly. Ring algorithms, for a payload
of N bytes (the full tensor of an all-reduce or reduce-scatter, the gathered
tensor of an all-gather, the rank's input of an all-to-all) on p ranks:

    all_reduce      2 (p-1)/p * N
    all_gather        (p-1)/p * N
    reduce_scatter    (p-1)/p * N
    all_to_all        (p-1)/p * N
    broadcast                  N      (the root's send)
    send_recv                  N      (one block to one peer, e.g. a ring shift)
    scatter           (p-1)/p * N     (the root's send)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def ring_bytes(kind: str, payload_bytes: int, p: int) -> int:
    """Bytes one rank sends for `kind` on p ranks with payload N.

    >>> ring_bytes("all_reduce", 1024, 4)
    1536
    """
    if p <= 1:
        return 0
    factor = {"all_reduce": 2 * (p - 1), "broadcast": p, "send_recv": p}.get(kind, p - 1)
    return payload_bytes * factor // p


@dataclass
class Bytes:
    """Bytes per rank, keyed by (collective kind, mesh axis); adds up."""

    by: Counter = field(default_factory=Counter)

    def add(self, kind: str, axis: str, payload_bytes: int, p: int) -> Bytes:
        self.by[(kind, axis)] += ring_bytes(kind, payload_bytes, p)
        return self

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.by + other.by)

    @property
    def total(self) -> int:
        return sum(self.by.values())

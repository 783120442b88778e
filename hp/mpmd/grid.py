"""Where each rank of a placed step sits: its data parallel replica, its rank in the graph, its tensor parallel plane.

`hp.mpmd.Placed` runs one graph of programs (`hp.mpmd.graph`) on many
more ranks than the graph names: `replicas` copies of the whole placement
for data parallel, each of `planes` copies for tensor parallel, whose ranks
hold one stage's shards and run its collectives together. `Grid` is that
arrangement as a value, and makes the process groups each concern needs
(the plane a runtime sends on, a spread program's ranks, the replicas a
gradient is summed over, the planes a cost table is agreed over), every
rank making every group in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hp.mpmd.runtime import members, own_group


@dataclass(frozen=True)
class Grid:
    """How a placed step's ranks (`members`, global) are laid out: `replicas` blocks in order, each the graph's
    `width` ranks times `planes` tensor parallel planes, the planes innermost: graph rank r of plane j in
    replica b is `members[(b * width + r) * planes + j]`.

    >>> grid = Grid(tuple(range(8)), replicas=2, planes=2)
    >>> grid.width, grid.where(7), grid.rank(1, 0, 1)
    (2, (1, 1, 1), 5)
    """

    members: tuple[int, ...]
    replicas: int = 1
    planes: int = 1

    @property
    def width(self) -> int:
        return len(self.members) // (self.replicas * self.planes)

    def rank(self, replica: int, r: int, plane: int) -> int:
        return self.members[(replica * self.width + r) * self.planes + plane]

    def where(self, rank: int) -> tuple[int, int, int]:
        """(replica, graph rank, plane) of global rank `rank`."""
        i = self.members.index(rank)
        return i // (self.width * self.planes), i // self.planes % self.width, i % self.planes

    def group(self, ranks: Sequence[int] | None = None, backend: str | None = None) -> Any:
        """This rank's group of graph ranks `ranks` (default all) in its replica's plane, of `backend` (None:
        the world's); every rank makes every replica's and plane's, in order (a collective)."""
        ranks = range(self.width) if ranks is None else ranks
        return own_group([[self.rank(b, r, j) for r in ranks] for b in range(self.replicas)
                          for j in range(self.planes)], backend)

    def across_planes(self) -> Any:
        """This rank's group over the planes (its replica's graph rank in each); None for one plane."""
        if self.planes == 1:
            return None
        return own_group([[self.rank(b, r, j) for j in range(self.planes)] for b in range(self.replicas)
                          for r in range(self.width)])

    def across(self) -> Any:
        """This rank's group over the replicas (its graph rank and plane in each); None for one replica."""
        if self.replicas == 1:
            return None
        return own_group([[self.rank(b, r, j) for b in range(self.replicas)] for r in range(self.width)
                          for j in range(self.planes)])


def replica_of(replicas: int, group: Any = None, planes: int = 1) -> tuple[int, int]:
    """(this rank's replica, its graph rank), `group`'s ranks (default: the world) laid out as `Placed(...,
    replicas=, planes=)` runs them (`Grid`): what a rank's programs are built for."""
    replica, rank, _ = Grid(tuple(members(group)), replicas, planes).where(dist.get_rank())
    return replica, rank

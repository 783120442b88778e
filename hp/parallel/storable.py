"""DTensors that checkpoints can store: fused parts travel through a contiguous stand-in.

`torch.distributed.checkpoint` (and its HF safetensors reader) describes each
rank's block of a tensor as one contiguous box of the global tensor. A weight
whose fused parts are each split over an axis (`[q k v]/tp`, a
`_StridedShard`) holds several boxes per rank, which DCP takes for one and
reports as overlapping. So before a save or a load such a tensor is
redistributed to the plain split of the same axes (a contiguous block per
rank, the same bytes per rank), and after a load it is redistributed back.
Everything else passes through untouched, so checkpoints stay resharding-safe
and HF files load rank by rank.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map


def _contiguous(placements) -> tuple:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _fused(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def to_storable(tree: Any) -> Any:
    """`tree` (a state dict, nested) with every fused-part DTensor as a contiguous-block copy.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     w = hp.shard(torch.arange(8.0).reshape(4, 2), "[gate up]/tp 2", mesh)
    ...     print(to_storable({"w": w})["w"].placements)
    (Shard(dim=0),)
    """
    return tree_map(lambda v: v.redistribute(v.device_mesh, _contiguous(v.placements)) if _fused(v) else v, tree)


def from_storable(tree: Any, like: Any) -> Any:
    """`tree` (as loaded into `to_storable(like)`) with each fused leaf back in `like`'s placements."""
    return tree_map(
        lambda v, old: v.redistribute(old.device_mesh, old.placements) if _fused(old) else v, tree, like
    )

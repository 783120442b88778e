"""Embedding lookup in a vocabulary-split table: masked local lookup, partial sum.

With the table laid out `vocab/tp h`, each rank looks up only the ids that
fall in its slice (others read row 0 and are zeroed) and the result is a
pending sum over tp (`... h +tp`), resolved where the layout says (the first
residual add, or an explicit `hp.constrain`). The gradient reaches only the
rows each rank owns. DTensor has a lowering of its own for this, but it
indexes with per-rank masks in a way `LocalTensorMode` cannot simulate; this
kernel computes the same numbers with arithmetic masks, so it simulates too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hp.ops.local import local_block, to_dtensor


def vocab_parallel_embedding(
    input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False
):
    """`F.embedding` with a table split on its rows over one mesh axis; NotImplemented otherwise.

    `max_norm` (renormalises rows in place), `scale_grad_by_freq` and `sparse` are left to DTensor.
    """
    if not isinstance(weight, DTensor) or max_norm is not None or scale_grad_by_freq or sparse:
        return NotImplemented
    row_axes = [m for m, p in enumerate(weight.placements) if p == Shard(0)]
    if len(row_axes) != 1 or any(
        not isinstance(p, Replicate) for m, p in enumerate(weight.placements) if m != row_axes[0]
    ):
        return NotImplemented
    axis, mesh = row_axes[0], weight.device_mesh
    if isinstance(input, DTensor):
        if not isinstance(input.placements[axis], Replicate):
            return NotImplemented
        id_placements, ids = input.placements, input.to_local()
    else:
        id_placements, ids = [Replicate()] * mesh.ndim, input
    rows = weight.shape[0] // mesh.size(axis)
    start = mesh.get_coordinate()[axis] * rows
    local_ids, mine = _local_ids(ids, start, rows)
    # ids split over other axes (data parallel): the table's gradient is a pending sum there
    split = [m for m, p in enumerate(id_placements) if isinstance(p, Shard)]
    out = F.embedding(local_ids, local_block(weight, split)) * mine.unsqueeze(-1).to(weight.dtype)
    if padding_idx is not None:  # the padding row is looked up but never trained
        pad = (input.to_local() if isinstance(input, DTensor) else input) == padding_idx % weight.shape[0]
        out = torch.where(pad.unsqueeze(-1), out.detach(), out)
    placements = [Partial() if m == axis else p for m, p in enumerate(id_placements)]
    return to_dtensor(out, mesh, placements, (*input.shape, weight.shape[1]))


@maybe_run_for_local_tensor  # rank-dependent: runs once per simulated rank
def _local_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    shifted = ids - start
    mine = (shifted >= 0) & (shifted < rows)
    return shifted * mine, mine

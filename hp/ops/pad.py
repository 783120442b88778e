"""`F.pad` of dims no rank splits runs on each rank's block.

HF's causal-LM loss pads the labels by one token (`b/dp s`, padded along
`s`) to shift them. Padding dims that every rank holds whole is exact on
each block, so hp pads the blocks and keeps the input's layout, without
DTensor's sharding propagation (whose pad rule some torch releases get
wrong on meshes of more than one axis). Padding a split dim, or a pending
sum, is left to DTensor.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops.local import local_block, to_dtensor


def blockwise_pad(input, pad, mode: str = "constant", value=None):
    """`F.pad` on each block when the padded dims are whole on every rank; NotImplemented otherwise.

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     y = F.pad(hp.shard(torch.ones(4, 3), "b/dp s", mesh), (0, 1), value=-100.0)
    ...     print(hp.describe(y), y.full_tensor()[0].tolist())
    f32[4/dp, 4] [1.0, 1.0, 1.0, -100.0]
    """
    if not isinstance(input, DTensor) or len(pad) % 2:
        return NotImplemented
    padded = range(input.ndim - len(pad) // 2, input.ndim)
    for p in input.placements:
        if isinstance(p, (Shard, _StridedShard)) and p.dim in padded:
            return NotImplemented
        if p.is_partial():
            return NotImplemented
    shape = list(input.shape)
    for i, d in enumerate(reversed(padded)):
        shape[d] += pad[2 * i] + pad[2 * i + 1]
    out = F.pad(local_block(input), pad, mode=mode, value=value)
    return to_dtensor(out, input.device_mesh, input.placements, shape)

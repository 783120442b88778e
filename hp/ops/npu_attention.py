"""Ascend's fused attention (`torch_npu.npu_fusion_attention`) on DTensors split over heads or batch.

The op takes the head count as an integer argument (`head_num`) and a layout
string for its inputs ("BNSD", "BSND", "BSH", "SBH"), so no sharding rule can
describe it: a rank holding a share of the heads must also be told how many
it holds. This kernel runs the op on each rank's local block with the local
head count, when q, k and v are split over batch and/or heads (never over
the sequence: context parallelism goes through `F.scaled_dot_product_attention`,
whose Ulysses and ring kernels run on NPUs too), and hands back the output
and the softmax statistics in the matching layouts. The op's own autograd
runs on the local blocks. Registered only when `torch_npu` is importable.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp.ops.local import to_dtensor

# for each input layout: (batch dim, heads dim, heads packed with head_dim into one hidden dim)
LAYOUTS = {"BNSD": (0, 1, False), "BSND": (0, 2, False), "BSH": (0, 2, True), "SBH": (1, 2, True)}


def fusion_attention_on_blocks(op: Callable, query, key, value, head_num: int, input_layout: str, *args, **kwargs):
    """`op(query, key, value, head_num, input_layout, ...)` on local blocks; NotImplemented when it cannot."""
    if not all(isinstance(t, DTensor) for t in (query, key, value)) or input_layout not in LAYOUTS:
        return NotImplemented
    if not (query.placements == key.placements == value.placements):
        return NotImplemented
    batch, heads, packed = LAYOUTS[input_layout]
    mesh, placements = query.device_mesh, query.placements
    if any(not (p == Replicate() or p in (Shard(batch), Shard(heads))) for p in placements):
        return NotImplemented  # a split sequence, head_dim or a pending sum
    head_parts = math.prod(mesh.size(m) for m, p in enumerate(placements) if p == Shard(heads))
    kv_heads = key.shape[heads] // (query.shape[heads] // head_num) if packed else key.shape[heads]
    if head_num % head_parts or kv_heads % head_parts:
        return NotImplemented
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value)]
    kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    out = op(*local, head_num // head_parts, input_layout, *args, **kwargs)
    stats = [Shard(0) if p == Shard(batch) else Shard(1) if p == Shard(heads) else p for p in placements]
    first = to_dtensor(out[0], mesh, placements, query.shape)
    rest = []
    for t in out[1:3]:  # softmax max and sum: (B, N, S, 8)
        shape = (query.shape[batch], head_num, *t.shape[2:])
        rest.append(to_dtensor(t, mesh, stats, shape))
    return (first, *rest, *out[3:])


def kernels() -> dict:
    """{torch_npu op: kernel} when torch_npu is installed, else empty."""
    if importlib.util.find_spec("torch_npu") is None:
        return {}
    import torch_npu  # noqa: F401  (registers torch.ops.npu)

    packet = torch.ops.npu.npu_fusion_attention

    def kernel(*args, **kwargs):
        return fusion_attention_on_blocks(packet, *args, **kwargs)

    return {packet: kernel, packet.default: kernel}

"""Fused projections: Megatron's column-parallel product, then each part sliced locally.

A packed weight laid out `[q k v]/a in` is `_StridedShard(0, n)` over a: rank
r holds q_r, k_r and v_r. Multiplying by it is the 1D column-parallel product
of hp/ops/linear.py (the same Megatron f, or gather of sequence-split
tokens), and the output's last dim lies as the weight's rows do,
`_StridedShard(last, n)`: rank r holds piece r of every part. Model code then
cuts the output at part boundaries (`qkv[..., :q]`, `.split`, `.chunk`,
`.narrow`). A piece made of whole parts is a slice of every rank's block, so
these kernels slice locally and return it as `Shard(last)` (one part) or
`_StridedShard(last, k)` (k parts): attention and the MLP then run on local
heads and features, and nothing moves. DTensor alone would gather the
output to slice it. A cut inside a part is left to DTensor (correct, but it
communicates).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops.linear import column_axis, column_product
from hp.ops.local import to_dtensor

Bounds = list[tuple[int, int]]


def fused_linear(input, weight, bias=None):
    """`F.linear` with a fused weight `[p1 ... pn]/a in`; NotImplemented for other layouts.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     w = hp.shard(torch.randn(12, 4), "[q k v]/tp in", mesh)
    ...     x = hp.shard(torch.randn(2, 4), "b h", mesh)
    ...     y = fused_linear(x, w)
    ...     print(hp.describe(y), torch.allclose(y.full_tensor(), x.full_tensor() @ w.full_tensor().T))
    f32[2, [4 4 4]=12/tp] True
    """
    a = column_axis(input, weight, bias)
    if a is None or not isinstance(weight.placements[a], _StridedShard):
        return NotImplemented
    parts = weight.placements[a].split_factor
    return column_product(input, weight, bias, a, _StridedShard(input.ndim - 1, split_factor=parts))


def fused_getitem(x, index):
    """`x[..., i:j]` on a fused last dim, cut at part boundaries, without communication.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     qkv = hp.shard(torch.arange(24.0).reshape(2, 12), "b [q k v]/tp", mesh)
    ...     kv = fused_getitem(qkv, (Ellipsis, slice(4, None)))
    ...     print(hp.describe(kv), kv.full_tensor()[0].tolist())
    f32[2, [4 4]=8/tp] [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    """
    bounds = _last_dim_slice(x, index)
    if bounds is None:
        return NotImplemented
    pieces = _pieces(x, [bounds])
    return pieces if pieces is NotImplemented else pieces[0]


def fused_split(tensor, split_size_or_sections=None, dim=0, *, split_size=None):
    """`Tensor.split` / `torch.split` of a fused last dim at part boundaries (see `fused_getitem`).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     qkv = hp.shard(torch.zeros(2, 12), "b [q k v]/tp", mesh)
    ...     print([hp.describe(p) for p in fused_split(qkv, [4, 8], dim=-1)])
    ['f32[2, 4/tp]', 'f32[2, [4 4]=8/tp]']
    """
    sizes = split_size_or_sections if split_size is None else split_size
    if not _is_last(tensor, dim):
        return NotImplemented
    total = tensor.shape[-1]
    if isinstance(sizes, int) and sizes > 0:
        sizes = [min(sizes, total - start) for start in range(0, total, sizes)]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) for n in sizes) or sum(sizes) != total:
        return NotImplemented
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = _pieces(tensor, [(s, s + n) for s, n in zip(starts, sizes)])
    return pieces if pieces is NotImplemented else tuple(pieces)


def fused_chunk(input, chunks, dim=0):
    """`Tensor.chunk` / `torch.chunk` of a fused last dim at part boundaries (see `fused_getitem`).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     gate_up = hp.shard(torch.zeros(2, 8), "b [gate up]/tp", mesh)
    ...     print([hp.describe(p) for p in fused_chunk(gate_up, 2, dim=-1)])
    ['f32[2, 4/tp]', 'f32[2, 4/tp]']
    """
    if not _is_last(input, dim) or not isinstance(chunks, int) or chunks <= 0:
        return NotImplemented
    step = -(-input.shape[-1] // chunks)  # torch.chunk's size: the last chunk may be smaller
    return fused_split(input, step, dim) if step else NotImplemented


def fused_narrow(input, dim, start, length):
    """`Tensor.narrow` / `torch.narrow` of a fused last dim at part boundaries (see `fused_getitem`).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     qkv = hp.shard(torch.zeros(2, 12), "b [q k v]/tp", mesh)
    ...     print(hp.describe(fused_narrow(qkv, 1, 4, 4)))
    f32[2, 4/tp]
    """
    if not _is_last(input, dim) or not isinstance(start, int) or not isinstance(length, int):
        return NotImplemented
    start = start + input.shape[-1] if start < 0 else start
    pieces = _pieces(input, [(start, start + length)])
    return pieces if pieces is NotImplemented else pieces[0]


def _is_last(x, dim) -> bool:
    return isinstance(x, DTensor) and isinstance(dim, int) and x.ndim > 0 and dim in (-1, x.ndim - 1)


def _last_dim_slice(x, index) -> tuple[int, int] | None:
    """(start, stop) when `index` takes a unit-step slice of x's last dim and all of every other dim."""
    if not isinstance(x, DTensor) or x.ndim == 0:
        return None
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is Ellipsis or type(i) is slice for i in items):
        return None
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        return None
    before = items[: ellipses[0]] if ellipses else items
    after = items[ellipses[0] + 1 :] if ellipses else ()
    if len(before) + len(after) > x.ndim:
        return None
    per_dim = list(before) + [slice(None)] * (x.ndim - len(before) - len(after)) + list(after)
    whole = slice(None)
    if any(s != whole for s in per_dim[:-1]):
        return None
    last = per_dim[-1]
    if not all(v is None or isinstance(v, int) for v in (last.start, last.stop, last.step)):
        return None
    return _unit_step_bounds(last, x.shape[-1])


def _unit_step_bounds(s: slice, n: int) -> tuple[int, int] | None:
    """`s.indices(n)`'s (start, stop) when `s` steps by 1, else None (spelled out: dynamo in
    torch 2.11 cannot trace `slice.indices`).

    >>> _unit_step_bounds(slice(-3, None), 8), _unit_step_bounds(slice(2, 99), 8), _unit_step_bounds(slice(0, 8, 2), 8)
    ((5, 8), (2, 8), None)
    """
    if s.step not in (None, 1):
        return None

    def bound(v, default):
        if v is None:
            return default
        return min(max(v + n if v < 0 else v, 0), n)

    return bound(s.start, 0), bound(s.stop, n)


def _pieces(x: DTensor, bounds: Bounds):
    """Each [start, stop) of x's fused last dim: cut from the local blocks when every cut falls between
    parts, else from the dim gathered; NotImplemented unless x's last dim is fused over one mesh axis
    (and split over no other)."""
    last = x.ndim - 1
    on_last = [m for m, p in enumerate(x.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == last]
    if len(on_last) != 1 or not isinstance(x.placements[on_last[0]], _StridedShard):
        return NotImplemented
    a = on_last[0]
    parts, ranks = int(x.placements[a].split_factor), x.device_mesh.size(a)
    part = x.shape[-1] // parts
    if x.shape[-1] % (parts * ranks) or any(start % part or stop % part or stop <= start for start, stop in bounds):
        # a cut inside a part needs the whole dim (torch 2.11's DTensor would slice the blocks as if contiguous)
        gathered = x.redistribute(x.device_mesh, [Replicate() if m == a else p for m, p in enumerate(x.placements)])
        return [gathered[..., start:stop] for start, stop in bounds]
    local, local_part = x.to_local(), part // ranks  # rank r's block: piece r of each part, in order
    pieces = []
    for start, stop in bounds:
        k = (stop - start) // part
        placements = list(x.placements)
        placements[a] = Shard(last) if k == 1 else _StridedShard(last, split_factor=k)
        block = local.narrow(last, start // part * local_part, k * local_part)
        # a slice of the last dim keeps its source's strides, globally as locally
        pieces.append(to_dtensor(block, x.device_mesh, placements, (*x.shape[:-1], stop - start), stride=x.stride()))
    return pieces


# Tensor methods and torch functions that cut the last dim (F.linear is chained in hp.region).
SLICES = {
    torch.Tensor.__getitem__: fused_getitem,
    torch.Tensor.split: fused_split,
    torch.split: fused_split,
    torch.Tensor.chunk: fused_chunk,
    torch.chunk: fused_chunk,
    torch.Tensor.narrow: fused_narrow,
    torch.narrow: fused_narrow,
}

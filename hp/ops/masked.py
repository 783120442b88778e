"""Masked positions of a sequence: scattered into in order, read and written by a boolean mask.

Vision-language models put the vision tower's output into the text this way
(`inputs_embeds.masked_scatter(image_mask, image_embeds)`), and Qwen3-VL adds
its deepstack features to the image positions of the residual stream
(`h[mask, :] = h[mask, :] + features`). The k-th masked position takes the
k-th row, so which row lands where depends on the whole mask: the leading
dimensions (batch, sequence) stay whole, and only the feature dimension may
be split. DTensor has a rule for neither (boolean indexing becomes a
data-dependent `nonzero`): masked scatter gets one, and boolean-mask reads
and writes of a DTensor run here on its replicated value (no communication
when it is replicated, as under tp; a sequence-split one is gathered, and a
write lands back in its own layout).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from hp.layouts.reshard import cut
from hp.ops.rule import rule

aten = torch.ops.aten


def _dims(n: int) -> list[str]:
    return [f"a{i}" for i in range(n)]


def _rows(self, source) -> bool:
    """Whether `source` is rows of `self`'s features (as the models pass it), not a flat fill."""
    return source.ndim == 2 and source.shape[-1] == self.shape[-1]


def _spec(self, mask, source) -> str:
    dims = " ".join([*_dims(self.ndim - 1), "h"])
    fill = "n h" if _rows(self, source) else " ".join("_" for _ in range(source.ndim))
    return f"{dims}, {dims}, {fill} -> {dims}"


def _whole(self, mask, source) -> str:
    return " ".join([*_dims(self.ndim - 1), "n" if _rows(self, source) else "h"])


def _backward_spec(grad, mask, sizes) -> str:
    dims = " ".join(_dims(grad.ndim))
    return f"{dims}, {dims} -> {' '.join('_' for _ in sizes)}"


def _backward_whole(grad, mask, sizes) -> str:
    # every dim: the op takes the source's global `sizes`, which a split would not match
    return " ".join(_dims(grad.ndim))


rule(aten.masked_scatter.default, _spec, whole=_whole)
rule(aten.masked_scatter_backward.default, _backward_spec, whole=_backward_whole)


def masked_scatter(x, mask, source):
    """`x.masked_scatter(mask, source)` of a replicated DTensor `x`, on each rank's copy; a pending
    gradient passes back pending (`NotImplemented` for other layouts: the rule above takes them).

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     x = hp.shard(torch.zeros(1, 3, 2), "b s h", mesh)
    ...     y = x.masked_scatter(torch.tensor([[[True], [False], [True]]]), torch.ones(2, 2))
    ...     print(hp.describe(y), y.full_tensor()[0, :, 0].tolist())
    f32[1, 3, 2] [1.0, 0.0, 1.0]
    """
    if not (_replicated_dtensor(x) and all(_replicated_dtensor(t) or not isinstance(t, DTensor)
                                           for t in (mask, source))):
        return NotImplemented
    return _MaskedScatter.apply(x, _local(mask), source)


class _MaskedScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, mask: torch.Tensor, source) -> DTensor:
        ctx.mask, ctx.source = mask, (source.shape, isinstance(source, DTensor))
        out = x.to_local().masked_scatter(mask, _local(source).to(x.dtype))
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if any(not (p.is_replicate() or p.is_partial()) for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [p if p.is_partial() else Replicate() for p in grad.placements])
        g = grad.to_local()
        mask = ctx.mask.expand_as(g)
        (shape, is_dtensor) = ctx.source
        to_x = DTensor.from_local(g.masked_fill(mask, 0), grad.device_mesh, grad.placements, run_check=False)
        to_source = aten.masked_scatter_backward(g, mask, shape)
        if is_dtensor:
            to_source = DTensor.from_local(to_source, grad.device_mesh, grad.placements, run_check=False)
        return to_x, None, to_source


def _replicated_dtensor(t) -> bool:
    return isinstance(t, DTensor) and all(p.is_replicate() for p in t.placements)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def masked_getitem(x, index):
    """`x[mask, ...]` of a DTensor `x` with a boolean mask, as a replicated DTensor.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     h = hp.shard(torch.arange(12.0).reshape(1, 4, 3), "b s/tp h", mesh)
    ...     rows = h[torch.tensor([[False, True, False, True]]), :]
    ...     print(hp.describe(rows), rows.full_tensor().tolist())
    f32[2, 3] [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]
    """
    local_index = _boolean_index(x, index)
    if local_index is None:
        return NotImplemented
    whole = _replicated(x)
    return DTensor.from_local(whole.to_local()[local_index], x.device_mesh, [Replicate()] * x.device_mesh.ndim,
                              run_check=False)


def masked_setitem(x, index, value):
    """`x[mask, ...] = value` of a DTensor `x` with a boolean mask; `x` keeps its layout.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh), hp.region():
    ...     h = hp.shard(torch.zeros(1, 4, 2), "b s/tp h", mesh)
    ...     h[torch.tensor([[False, True, False, True]]), :] = torch.ones(2, 2)
    ...     print(hp.describe(h), h.full_tensor()[0, :, 0].tolist())
    f32[b=1, s=4/tp, h=2] [0.0, 1.0, 0.0, 1.0]
    """
    local_index = _boolean_index(x, index)
    if local_index is None:
        return NotImplemented
    whole = _replicated(x)
    written = _rows_written(whole, local_index, value)
    if written is NotImplemented:
        rows = value.full_tensor() if isinstance(value, DTensor) else value
        local = whole.to_local().clone()
        local[local_index] = rows.to(x.dtype)
        written = DTensor.from_local(local, x.device_mesh, whole.placements, run_check=False)
    x.copy_(cut(written, x.placements))  # each rank writes its own block; the value's gradient pends over the split
    return None


def _rows_written(whole: DTensor, index: tuple, value):
    """`whole[mask] = rows` (or `whole[mask, :]`) as a masked scatter, whose backward keeps a pending
    gradient pending; NotImplemented for other indexing or a split value."""
    mask = index[0]
    if index[1:] not in ((), (slice(None),)) or mask.ndim >= whole.ndim:
        return NotImplemented
    mask = mask.reshape(*mask.shape, *[1] * (whole.ndim - mask.ndim)).expand(whole.shape)
    return masked_scatter(whole, mask, value)


def _boolean_index(x, index) -> tuple | None:
    """`index` with plain tensors for a DTensor `x` indexed by a boolean mask; None otherwise."""
    if not isinstance(x, DTensor):
        return None
    parts = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
        return None
    return tuple(p.full_tensor() if isinstance(p, DTensor) else p for p in parts)


def _replicated(x: DTensor) -> DTensor:
    placements = [Replicate()] * x.device_mesh.ndim
    return x if tuple(x.placements) == tuple(placements) else x.redistribute(x.device_mesh, placements)

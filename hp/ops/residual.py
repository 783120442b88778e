"""Adding a partial sum to a laid-out tensor resolves the sum into that tensor's layout.

`residual + proj(x)` where `proj` is row-parallel adds a pending sum
(`+tp`) to the residual stream. DTensor picks the locally cheapest strategy,
which turns the residual stream batch-sharded (a reduce-scatter) and then
gathers weights in the next layer. The Megatron choice keeps the residual's
layout: an all-reduce when it is replicated, a reduce-scatter when it is
sequence-sharded (sequence parallel). This rule makes that choice: in an
add or subtract of same-shape DTensors, partial operands are redistributed
to the layout of the first operand that is not partial.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

ADDITIVE = {
    torch.add, torch.sub, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.__add__,
    torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.add_,
    torch.Tensor.__iadd__,
}


def _is_partial(x) -> bool:
    return isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements)


def resolve_partials(func, args, kwargs):
    """The additive call with partial operands moved to the anchor's layout, or NotImplemented."""
    operands = [a for a in args[:2] if isinstance(a, DTensor)]
    if len(operands) < 2 or operands[0].shape != operands[1].shape:
        return NotImplemented
    anchor = next((a for a in operands if not _is_partial(a)), None)
    if anchor is None or not any(_is_partial(a) for a in operands):
        return NotImplemented
    moved = tuple(
        a.redistribute(anchor.device_mesh, anchor.placements) if _is_partial(a) else a
        for a in args[:2]
    )
    return func(*moved, *args[2:], **kwargs)


def _kernel(func):
    def residual_add(*args, **kwargs):
        return resolve_partials(func, args, kwargs)

    return residual_add


KERNELS = {f: _kernel(f) for f in ADDITIVE}

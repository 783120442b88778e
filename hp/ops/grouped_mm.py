"""`torch._grouped_mm` (MoE expert matmuls) on DTensors, fp32 included.

The CPU kernel runs in fp32 and bf16, but the meta function that DTensor's
propagation uses insists on bf16; fp32 gets a meta function of its own here
(the shapes are the same). The rule: with 2D tokens against 3D expert
weights and group offsets, the output features may be split and the
contraction gives partial sums, while tokens and experts stay whole (the
offsets index them; expert parallelism is a dispatch algorithm, not a
split of this op). A 3D x 3D batched call may also split its batch.
"""

from __future__ import annotations

import torch
from torch._decomp import global_decomposition_table

from hp.ops.rule import rule

aten = torch.ops.aten
_META = global_decomposition_table["meta"]
_original_meta = _META.get(aten._grouped_mm.default)


def _meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if mat_a.dtype != torch.float32 or _original_meta is None:
        return _original_meta(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    elif mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    else:
        shape = (mat_a.size(1), mat_b.size(1))
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


# Fake tensors (and so DTensor's propagation) read the Python meta table, then the Meta kernel.
_META[aten._grouped_mm.default] = _meta
_LIB = torch.library.Library("aten", "IMPL")
# torch 2.11 registers a Python Meta kernel of its own (bf16 only), which fake tensors call first
_LIB.impl("_grouped_mm", _meta, "Meta", allow_override=True)


def _spec(mat_a, mat_b, offs=None, *rest, **kw) -> str:
    if mat_a.ndim == 2 and mat_b.ndim == 3:
        return "t k, e k n, e -> t n" if offs is not None else "t k, e k n -> t n"
    if mat_a.ndim == 3 and mat_b.ndim == 3:
        return "e m k, e k n -> e m n"
    return "_ _, _ _, _ -> _ _"


def _whole(mat_a, mat_b, offs=None, *rest, **kw) -> str:
    return "t e" if mat_a.ndim == 2 and mat_b.ndim == 3 else ""


rule(aten._grouped_mm.default, _spec, sum="k", whole=_whole)

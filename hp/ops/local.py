"""The way back from a kernel's local blocks to a DTensor, shared by hp's kernels.

Kernels (2D linear, vocab-parallel loss, Ulysses attention, ...) compute on
each rank's local block and hand the result back as a DTensor. The local
result is contiguous, so the global stride must say so too: DTensor trusts it
when a later `.contiguous()` or `.view()` decides whether to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import _StridedShard

from hp.layouts.specs import new_dtensor, spec_for


def to_dtensor(
    local: torch.Tensor, mesh, placements: Sequence[Placement], shape, dim_order=None, stride=None
) -> DTensor:
    """Wrap a local block as a DTensor of global `shape` (differentiable).

    The block is contiguous, or, with `dim_order`, a permuted view of a contiguous buffer whose
    dims, outermost first, are `dim_order` (the global stride then says the same), or, with
    `stride`, a view whose global tensor has that stride (a slice keeps its source's).
    Its gradient comes back as `placements` say (a partial sum's as replicated), as with
    `DTensor.from_local`, which this replaces on hot paths: the spec is built once per
    signature and the wrap is one small autograd step.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> to_dtensor(torch.zeros(4, 3), mesh, [torch.distributed.tensor.Shard(1)], (4, 6)).stride()
    (6, 1)
    """
    shape = tuple(shape)
    if stride is None:
        stride = _dense_stride(shape, tuple(dim_order) if dim_order is not None else tuple(range(len(shape))))
    if torch.compiler.is_compiling():  # dynamo traces DTensor's own wrap, not a spec cache
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
    return _Wrap.apply(local, spec_for(mesh, tuple(placements), shape, tuple(stride), local.dtype))


def _dense_stride(shape: tuple, order: tuple) -> tuple:
    """The stride of a contiguous buffer of `shape` whose dims, outermost first, are `order`."""
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = step
        step *= max(int(shape[d]), 1) if isinstance(shape[d], int) else shape[d]
    return tuple(stride)


class _Wrap(torch.autograd.Function):
    """A local block as a DTensor of `spec`; backward, the gradient's block as `spec` lays it."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return new_dtensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor | None):
        if not isinstance(grad, DTensor):
            return grad, None
        wanted = tuple(Replicate() if p.is_partial() else p for p in ctx.spec.placements)
        if tuple(grad.placements) != wanted and _only_cuts(grad.placements, wanted):
            mesh = ctx.spec.mesh
            return cut_block(grad._local_tensor, grad.placements, wanted, mesh.get_coordinate(), mesh.shape), None
        if tuple(grad.placements) != wanted:
            target = DTensorSpec(ctx.spec.mesh, wanted, tensor_meta=grad._spec.tensor_meta)
            return redistribute_local_tensor(grad._local_tensor, grad._spec, target), None
        # a graph of the backward itself (create_graph=True) needs the differentiable unwrap
        return (grad.to_local() if torch.is_grad_enabled() else grad._local_tensor), None


def _only_cuts(have: Sequence[Placement], wanted: Sequence[Placement]) -> bool:
    """`wanted` only splits what `have` holds whole, a strided shard among the splits.

    Some torch releases cannot redistribute into a strided shard that stands alone on its
    dim (as flattening `b s/cp` leaves the rows); cutting each rank's block needs no help.
    """
    cuts = [w for h, w in zip(have, wanted) if h != w]
    dims = [w.dim for w in wanted if isinstance(w, (Shard, _StridedShard))]
    return (any(isinstance(w, _StridedShard) for w in cuts) and len(dims) == len(set(dims))
            and all(h.is_replicate() and isinstance(w, (Shard, _StridedShard)) for h, w in zip(have, wanted) if h != w))


@maybe_run_for_local_tensor  # rank-dependent: runs once per simulated rank
def cut_block(whole: torch.Tensor, have, wanted, coordinate, sizes) -> torch.Tensor:
    """This rank's block of `whole` (whole on the mesh dims where `wanted` splits it), as DTensor splits it:
    `torch.chunk`'s pieces, and an empty block for a rank past a dim shorter than its mesh dim."""
    block = whole
    for m, (h, w) in enumerate(zip(have, wanted)):
        if h == w:
            continue
        n, c = sizes[m], coordinate[m]
        if isinstance(w, _StridedShard):  # the dim as (split_factor, rest): each rank takes its part of rest
            sf = w.split_factor
            parts = block.unflatten(w.dim, (sf, block.shape[w.dim] // sf))
            block = parts.chunk(n, w.dim + 1)[c].flatten(w.dim, w.dim + 1)
        else:
            pieces = block.chunk(n, w.dim)
            block = pieces[c] if c < len(pieces) else block.narrow(w.dim, 0, 0)
    return block.contiguous()


def local_block(param: DTensor, pending_axes: Sequence[int] = ()) -> torch.Tensor:
    """`param`'s block (differentiable); its gradient is a pending sum over `pending_axes`
    (mesh axes that split the tokens it met) and otherwise laid out as `param`.

    `DTensor.to_local` at a fraction of its cost on hot paths: one small autograd step, the
    gradient's spec built once per signature.
    """
    compiling = torch.compiler.is_compiling()
    if not param.requires_grad:
        return param.to_local() if compiling else param._local_tensor
    # as DTensor.to_local: a pending sum's gradient is whole on every rank
    grads = tuple(Partial() if m in pending_axes else Replicate() if p.is_partial() else p
                  for m, p in enumerate(param.placements))
    if compiling:
        return param.to_local(grad_placements=grads)
    return _Unwrap.apply(param, grads)


class _Unwrap(torch.autograd.Function):
    """`x`'s block; backward, the block's gradient as a DTensor laid out as `grads` say."""

    @staticmethod
    def forward(ctx, x: DTensor, grads: tuple[Placement, ...]) -> torch.Tensor:
        ctx.spec, ctx.grads = x._spec, grads
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None
        spec = ctx.spec
        shape = tuple(spec.shape)
        if grad.is_contiguous():
            stride = _dense_stride(shape, tuple(range(len(shape))))
        else:
            stride = tuple(compute_global_tensor_info(grad, spec.mesh, ctx.grads)[1])
        return new_dtensor(grad, spec_for(spec.mesh, ctx.grads, shape, stride, grad.dtype), requires_grad=False), None


def copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Fill `param` (laid out or plain) from the whole tensor `whole`: each rank keeps its block of it.

    For values drawn or read whole on every rank (adapters, a value head) into a laid-out model.

    >>> p = torch.nn.Parameter(torch.zeros(2)); copy_whole(p, torch.ones(2)); p.tolist()
    [1.0, 1.0]
    """
    from torch.distributed.tensor import distribute_tensor

    if isinstance(param, DTensor):
        whole = distribute_tensor(whole.to(param.device_mesh.device_type), param.device_mesh, param.placements)
    with torch.no_grad():
        param.copy_(whole)


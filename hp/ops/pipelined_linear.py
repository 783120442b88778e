"""Megatron's linears pipelined over token chunks: one chunk's collective flies while another multiplies.

Inside `hp.mpmd` the tensor-parallel linears cut their tokens into
`hp.ops.overlap.chunks()` chunks:

* **column parallel** (`out/tp in`), the first linear to read an input.
  Under sequence parallel every chunk of the rank's tokens is all-gathered
  at once, and each chunk is multiplied as soon as it lands. Backward, each
  chunk's input gradient is reduce-scattered (all-reduced, without sequence
  parallel: Megatron's f) as soon as it is computed, while the next chunk's
  is, and the weight's gradient computes while the last one flies. The
  gathered input is the layer's shared one: the other linears that read it
  (k and v; up) use it whole, and their gradients join before the pipelined
  reduction, as they join before the plain one.
* **row parallel** (`out in/tp`) in a module whose output joins the
  residual stream (`hp.ops.overlap.reduce_into` names the layout it resolves
  into): each chunk's partial sums are reduce-scattered (all-reduced) as
  soon as they are computed, while the next chunk multiplies. Backward,
  every chunk of the output gradient is all-gathered at once, and each is
  multiplied as soon as it lands.

Chunk c of a rank's sequence block is its piece c; gathered, a chunk holds
piece c of every rank's block, and reduce-scattered, it leaves each rank
its piece c. So the collectives move exactly the bytes of the unpipelined
ones, in `chunks` calls each. Over one chunk (the step as it is, measured
by `hp.mpmd`) each kernel is the plain one, every wait timed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hp.ops import overlap
from hp.ops.collectives import (ALL_REDUCE, REDUCE_SCATTER, issue_all_gather, issue_all_reduce,
                                issue_reduce_scatter, landed_gather)


def chunk_sizes(length: int, count: int) -> list[int]:
    """`length` tokens cut into `count` chunks (fewer when there are fewer tokens), the first ones larger.

    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    """
    count = max(1, min(count, length))
    base, extra = divmod(length, count)
    return [base + (c < extra) for c in range(count)]


def interleaved(whole: torch.Tensor, ranks: int, sizes: list[int], dim: int) -> list[torch.Tensor]:
    """`whole` (every rank's block along `dim`, in rank order) as chunks: chunk c holds each block's piece c.

    >>> [c.tolist() for c in interleaved(torch.arange(6), 2, [2, 1], 0)]
    [[0, 1, 3, 4], [2, 5]]
    """
    blocks = whole.unflatten(dim, (ranks, sum(sizes)))
    return [piece.flatten(dim, dim + 1) for piece in blocks.split(sizes, dim + 1)]


def joined(chunks: list[torch.Tensor], ranks: int, dim: int) -> torch.Tensor:
    """The inverse of `interleaved`: the chunks' pieces put back in their blocks.

    >>> joined([torch.tensor([0, 1, 3, 4]), torch.tensor([2, 5])], 2, 0).tolist()
    [0, 1, 2, 3, 4, 5]
    """
    return torch.cat([c.unflatten(dim, (ranks, -1)) for c in chunks], dim + 1).flatten(dim, dim + 1)


def _weight_grads(grad: torch.Tensor, input: torch.Tensor, needs: tuple[bool, bool]):
    flat_grad = grad.flatten(0, -2)
    grad_w = flat_grad.t() @ input.flatten(0, -2) if needs[0] else None
    grad_b = flat_grad.sum(0) if needs[1] else None
    return grad_w, grad_b


def _gathered(pieces: list[torch.Tensor], dim: int, group, product) -> tuple[list, list]:
    """(each piece gathered along `dim`, `product` of it): every gather is issued at once and
    each product computed as soon as its piece lands, while the later ones fly."""
    flying = [issue_all_gather(piece, dim, group) for piece in pieces]
    landed, products = [], []
    for pending in flying:
        landed.append(landed_gather(pending, dim))
        products.append(product(landed[-1]))
    return landed, products


def _issue_reductions(products, dim: int, group, scatter: bool) -> list[torch.Tensor]:
    """Each of `products` (computed one after the other) reduce-scattered along `dim`, or all-reduced,
    issued as soon as it is computed: the next one computes while it flies."""
    return [issue_reduce_scatter(p, dim, group) if scatter else issue_all_reduce(p, "sum", group) for p in products]


def _landed(flying: list[torch.Tensor], dim: int, scatter: bool) -> torch.Tensor:
    """The `_issue_reductions` once landed, put back together along `dim`."""
    kind = REDUCE_SCATTER if scatter else ALL_REDUCE
    return torch.cat([overlap.wait(pending, kind) for pending in flying], dim)


class _Column(torch.autograd.Function):
    """Column-parallel product of the rank's tokens: (the shared input, the output block).

    With `gather`, the input's tokens are split over `group` along `dim` and gathered chunk by
    chunk; without, they are whole and only the input gradient's all-reduce is pipelined.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim: int, group, count: int, gather: bool):
        ranks = group.size()
        sizes = chunk_sizes(x.shape[dim], count)
        if gather:
            ins, outs = _gathered(x.split(sizes, dim), dim, group, lambda piece: F.linear(piece, weight, bias))
            shared, out = joined(ins, ranks, dim), joined(outs, ranks, dim)
        else:
            shared, out = x.view_as(x), F.linear(x, weight, bias)
        ctx.save_for_backward(shared, weight)
        ctx.dim, ctx.group, ctx.sizes, ctx.gather = dim, group, sizes, gather
        ctx.set_materialize_grads(False)  # an input no other linear reads has no gradient to add
        return shared, out

    @staticmethod
    def backward(ctx, grad_shared, grad_out):
        shared, weight = ctx.saved_tensors
        dim, group, sizes, gather = ctx.dim, ctx.group, ctx.sizes, ctx.gather
        if grad_out is None:
            grad_out = torch.zeros((*shared.shape[:-1], weight.shape[0]), dtype=shared.dtype, device=shared.device)

        def cut(t):  # the chunks as forward cut them
            return interleaved(t, group.size(), sizes, dim) if gather else list(t.split(sizes, dim))

        extra = cut(grad_shared) if grad_shared is not None else [None] * len(sizes)
        grads_in = (g @ weight if more is None else more + g @ weight for g, more in zip(cut(grad_out), extra))
        flying = _issue_reductions(grads_in, dim, group, gather)
        grad_w, grad_b = _weight_grads(grad_out, shared, ctx.needs_input_grad[1:3])  # while the last one flies
        return _landed(flying, dim, gather), grad_w, grad_b, None, None, None, None


class _Row(torch.autograd.Function):
    """Row-parallel product whose partial sums are reduce-scattered along `dim` (`scatter`) or
    all-reduced over `group`, chunk by chunk as they are computed."""

    @staticmethod
    def forward(ctx, x, weight, dim: int, group, count: int, scatter: bool):
        ranks = group.size()
        sizes = chunk_sizes(x.shape[dim] // ranks if scatter else x.shape[dim], count)
        ins = interleaved(x, ranks, sizes, dim) if scatter else x.split(sizes, dim)
        flying = _issue_reductions((F.linear(piece, weight) for piece in ins), dim, group, scatter)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group, ctx.sizes, ctx.scatter = dim, group, sizes, scatter
        return _landed(flying, dim, scatter)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        if ctx.scatter:
            grads, grads_in = _gathered(grad.split(ctx.sizes, dim), dim, group, lambda g: g @ weight)
            grad, grad_x = joined(grads, group.size(), dim), joined(grads_in, group.size(), dim)
        else:  # an all-reduce's gradient is whole on every rank already
            grad_x = grad @ weight
        grad_w, _ = _weight_grads(grad, x, (ctx.needs_input_grad[1], False))
        return grad_x, grad_w, None, None, None, None


def column(x: torch.Tensor, weight: torch.Tensor, bias, dim: int, group, gather: bool):
    """(the input as the other linears reading it share it, the column-parallel output block)."""
    return _Column.apply(x, weight, bias, dim, group, overlap.chunks(), gather)


def row(x: torch.Tensor, weight: torch.Tensor, dim: int, group, scatter: bool) -> torch.Tensor:
    """The row-parallel output block, its partial sums resolved over `group` (scattered along `dim`)."""
    return _Row.apply(x, weight, dim, group, overlap.chunks(), scatter)

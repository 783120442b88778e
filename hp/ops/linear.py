"""Tensor-parallel linear kernels: 1D column-parallel (Megatron's f), 2D, and blockwise.

1D: a weight laid out `out/a in` on a replicated input computes its output
slice locally; backward, the input gradient is a partial sum over a. Left to
DTensor, that partial meets the residual stream's gradient inside autograd's
accumulation, where DTensor picks the locally cheapest strategy (reduce-
scatter, later all-gather). Megatron's `f` operator fixes the place instead:
the input passes through an identity whose backward all-reduces over a, and
linears that read one input (q, k, v; gate, up) share it, so backward sums
their partials locally and all-reduces once. A fused weight (`[q k v]/a in`)
runs the same product (`column_axis`, `column_product`; see hp/ops/fused.py).

2D tensor-parallel linear: weight split over two mesh axes, tokens over both.

For `y = x W^T` with the weight laid out `out/o in/i` (o != i) and the input
`... tokens/o ... in/i`, each rank gathers its tokens over o (all-gather),
multiplies by its weight block, and scatters the partial sums over i along
the tokens (reduce-scatter): the output is `... tokens/i ... out/o`, ready
for a next weight laid out `out2/i in2/o`. Backward mirrors it: gather the
output gradient over i, scatter the input gradient over o; the weight
gradient is local because the gathered input is saved (MindSpore-style 2D).

Linears that share an input (q, k, v; gate, up) share its gather: the gather
is its own autograd step, cached per input tensor, so forward gathers once
and backward reduce-scatters the summed input gradient once.

SUMMA / Optimus-style 2D: the weight `out/a in/b` and the input
`tokens/b in/a` (features on the weight's out-axis) meet by gathering the
input's features over a and the weight's input dim over b; the local product
is exact and the output is `tokens/b out/a`, the input's own pattern, so
consecutive linears chain without alternating. Backward reduce-scatters the
input gradient over a and the weight gradient over b. It moves weights, not
only activations: the planner prices both and picks.

Tokens may also be split over further mesh axes that come before o and i in
the mesh (`tokens/z/o`, the token-sharded 3D variant): the weight is then
replicated over z, and its gradient is left as a pending sum over z
(`+z`), reduced where the training step reduces gradients (as data
parallelism does).

Blockwise: a replicated weight, or one split by its input features as the
input's are (row parallel), multiplies each rank's block as it is; the
output keeps the input's token layout, a pending sum over the row axis.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops import overlap, pipelined_linear
from hp.ops.collectives import all_gather, all_reduce, reduce_scatter
from hp.ops.local import local_block, to_dtensor


class _Gather(torch.autograd.Function):
    """All-gather along a dim over a mesh axis forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, local, dim: int, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(local, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceGradient(torch.autograd.Function):
    """Megatron's f: identity forward; all-reduce of the (partial) gradient backward."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, "sum", ctx.group), None


class _MatmulScatter(torch.autograd.Function):
    """Local block product, partial sums reduce-scattered over a mesh axis along tokens."""

    @staticmethod
    def forward(ctx, gathered, weight, bias, dim: int, group):
        ctx.save_for_backward(gathered, weight)
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        out = reduce_scatter(gathered @ weight.t(), dim, group)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad_all = all_gather(grad, ctx.dim, ctx.group)  # every token's output gradient
        grad_in = grad_all @ weight  # partial over the other axis: its gather's backward sums it
        flat_grad, flat_in = grad_all.flatten(0, -2), gathered.flatten(0, -2)
        grad_w = flat_grad.t() @ flat_in
        grad_b = flat_grad.sum(0) if ctx.has_bias else None
        return grad_in, grad_w, grad_b, None, None


def _shared(input: DTensor, step: str, axis: int, make) -> torch.Tensor:
    """`make()` once per (input, step, axis) while the input lives: the linears that read one
    input (q, k and v) share its gather, and their gradients meet before one reduction.

    Kept on the input tensor itself, which `torch.compile` traces as an intermediate's
    attribute (a global cache would make every prepared tensor an output of the graph).
    """
    name = _shared_name(step, axis)
    prepared = getattr(input, name, None)
    if prepared is None:
        prepared = make()
        setattr(input, name, prepared)
    return prepared


def _shared_name(step: str, axis: int) -> str:
    return f"_hp_{step}{axis}"


def _pipelines(mesh, axis: int) -> bool:
    """Whether a kernel over mesh `axis` takes the pipelined path: inside `hp.mpmd`, over ranks, eager
    and without autocast (the pipelined backward multiplies in the saved tensors' own dtypes)."""
    return (not torch.compiler.is_compiling() and overlap.active() and mesh.size(axis) > 1
            and not torch.is_autocast_enabled())


def _cut_dim(input) -> int:
    """The dim a pipelined kernel cuts whole tokens along: the sequence of `b s h`, the tokens of `t h`."""
    return max(input.ndim - 2, 0)


def linear(input, weight, bias=None):
    """`F.linear` for the layouts of the module docstring; NotImplemented otherwise.

    Which kernel applies depends on the layouts and shapes alone: it is looked for once per
    signature (kept on the weight's mesh), and the kernels before it are not asked again.
    """
    chosen, key = _chosen(input, weight, bias)
    try:
        first = chosen.get(key, 0) if chosen is not None else 0
    except TypeError:  # symbolic sizes do not hash
        chosen, first = None, 0
    for k, kernel in enumerate(_KERNELS[first:], first):
        out = kernel(input, weight, bias)
        if out is not NotImplemented:
            break
    else:
        k, out = len(_KERNELS), NotImplemented
    if chosen is not None and first == 0:
        if len(chosen) >= _SIGNATURES:
            chosen.clear()
        chosen[key] = k
    return out


def _chosen(input, weight, bias) -> tuple[dict | None, tuple | None]:
    """(the weight mesh's record of chosen kernels, this call's key in it); (None, None) for plain
    or traced tensors."""
    if torch.compiler.is_compiling() or not (isinstance(input, DTensor) and isinstance(weight, DTensor)):
        return None, None
    key = (input.placements, input.shape, input.device_mesh is weight.device_mesh, weight.placements,
           weight.shape, bias.placements if isinstance(bias, DTensor) else bias is None)
    return weight.device_mesh.__dict__.setdefault("_hp_linear_kernels", {}), key


def linear_summa(input, weight, bias=None):
    """SUMMA-style 2D linear (module docstring); NotImplemented when the layouts differ."""
    if not (isinstance(input, DTensor) and isinstance(weight, DTensor)) or weight.ndim != 2:
        return NotImplemented
    mesh, w, x, last = weight.device_mesh, weight.placements, input.placements, input.ndim - 1
    split = {m: p for m, p in enumerate(w) if not isinstance(p, Replicate)}
    if input.device_mesh != mesh or len(split) != 2 or sorted([getattr(p, "dim", -1) for p in split.values()]) != [0, 1]:
        return NotImplemented
    if any(not isinstance(p, Shard) for p in split.values()):
        return NotImplemented
    a = next(m for m, p in split.items() if p.dim == 0)
    b = next(m for m, p in split.items() if p.dim == 1)
    if x[a] != Shard(last) or not isinstance(x[b], Shard) or x[b].dim == last:
        return NotImplemented
    # tokens may be split over further axes (the batch over dp, the sequence over cp): the weight is
    # replicated there, and its gradient a pending sum
    rows = [m for m, p in enumerate(x) if m not in (a, b) and isinstance(p, Shard) and p.dim != last]
    if any(not isinstance(p, Replicate) for m, p in enumerate(x) if m not in (a, b, *rows)):
        return NotImplemented
    if bias is not None and (not isinstance(bias, DTensor) or bias.placements[a] != Shard(0)):
        return NotImplemented
    full_in = _shared(
        input, "features", a, lambda: _Gather.apply(local_block(input), last, mesh.get_group(a))
    )
    full_w = _Gather.apply(local_block(weight, rows), 1, mesh.get_group(b))
    # tokens are split over b: the bias gradient is a pending sum over b
    out = F.linear(full_in, full_w, local_block(bias, [b, *rows]) if bias is not None else None)
    placements = list(x)
    placements[a], placements[b] = Shard(last), Shard(x[b].dim)
    return to_dtensor(out, mesh, placements, (*input.shape[:-1], weight.shape[0]))


def column_parallel(input, weight, bias=None):
    """1D column-parallel linear; NotImplemented when the layouts differ.

    A replicated input passes through Megatron's f (shared by the linears that read it); a
    sequence-parallel input (tokens split over the weight's axis) is all-gathered over it
    (its backward reduce-scatters), the Megatron-SP pattern.
    """
    a = column_axis(input, weight, bias)
    if a is None or not isinstance(weight.placements[a], Shard):
        return NotImplemented
    return column_product(input, weight, bias, a, Shard(input.ndim - 1))


def blockwise_linear(input, weight, bias=None):
    """`F.linear` on each rank's block where that is exact without communication; NotImplemented otherwise.

    On each mesh axis the weight is replicated (the input's tokens may be split there: the weight's
    gradient is then a pending sum over that axis) or split by its input features as the input's
    features are (Megatron's row parallel: the output is a pending sum over that axis, for the
    residual stream's layout to resolve). DTensor would compute the same blocks, through a
    sharding propagation per op (and some torch releases refuse to flatten a split sequence dim).

    A replicated weight meeting tokens split by the batch only (data parallel) is left to
    DTensor: FSDP2 frees its gathered weights after forward, and saved as plain blocks here
    they were taken for activations by `hp.offload`, which then moved freed storage.
    """
    if not (isinstance(input, DTensor) and isinstance(weight, DTensor)) or weight.ndim != 2:
        return NotImplemented
    mesh, last = weight.device_mesh, input.ndim - 1
    if input.device_mesh != mesh:
        return NotImplemented
    rows, tokens = [], []
    for m, (x, w) in enumerate(zip(input.placements, weight.placements)):
        if isinstance(w, Replicate) and (isinstance(x, Replicate) or (isinstance(x, Shard) and x.dim != last)):
            tokens += [m] if isinstance(x, Shard) else []
        elif isinstance(w, Shard) and w.dim == 1 and isinstance(x, Shard) and x.dim == last:
            rows.append(m)
        else:
            return NotImplemented
    if not rows and all(input.placements[m].dim == 0 for m in tokens):
        return NotImplemented  # only the batch split (data parallel): see the docstring
    if len(rows) > 1 or (bias is not None and (not isinstance(bias, DTensor)
                                               or not all(p.is_replicate() for p in bias.placements))):
        return NotImplemented
    resolved = _resolved_here(input, weight, rows) if bias is None else None
    if resolved is not None:
        placements, dim, scatter = resolved
        out = pipelined_linear.row(local_block(input), local_block(weight, tokens), dim, mesh.get_group(rows[0]), scatter)
        return to_dtensor(out, mesh, placements, (*input.shape[:-1], weight.shape[0]))
    out = F.linear(local_block(input), local_block(weight, tokens))
    if bias is not None:  # a row-parallel product's bias is added once to its pending sum: on the axis' first rank
        b = local_block(bias, [*tokens, *rows])
        out = out + (_OnFirstRank.apply(b, mesh.get_local_rank(rows[0])) if rows else b)
    placements = [Partial() if m in rows else p for m, p in enumerate(input.placements)]
    return to_dtensor(out, mesh, placements, (*input.shape[:-1], weight.shape[0]))


class _OnFirstRank(torch.autograd.Function):
    """`t` on the rank of coordinate 0, zeros elsewhere (and so its gradient)."""

    @staticmethod
    def forward(ctx, t, coord):
        ctx.coord = coord
        return _first_only(t, coord)

    @staticmethod
    def backward(ctx, grad):
        return _first_only(grad, ctx.coord), None


@maybe_run_for_local_tensor  # which rank adds the bias depends on its coordinate
def _first_only(t: torch.Tensor, coord: int) -> torch.Tensor:
    return t.clone() if coord == 0 else torch.zeros_like(t)


def _resolved_here(input, weight, rows):
    """(placements, token dim, scatter) when a row-parallel product resolves its own pending sum, pipelined:
    inside `hp.mpmd`, its module told the layout (`hp.ops.overlap.reduce_into`), and that layout is the
    input's with the row axis replicated (Megatron's all-reduce) or splitting the input's whole tokens
    (sequence parallel's reduce-scatter). None otherwise: the pending sum is left to the module's output."""
    if len(rows) != 1 or not _pipelines(weight.device_mesh, rows[0]):
        return None
    target = overlap.reduction(weight)
    if target is None:
        return None
    (a,) = rows
    size, last = weight.device_mesh.size(a), input.ndim - 1
    if any(t != p for m, (t, p) in enumerate(zip(target, input.placements)) if m != a):
        return None
    if isinstance(target[a], Replicate):
        return tuple(target), _cut_dim(input), False
    dim = getattr(target[a], "dim", last)
    split_after = any(getattr(p, "dim", None) == dim for p in input.placements[a:])  # a's block would not be local
    if not isinstance(target[a], Shard) or dim == last or split_after or input._local_tensor.shape[dim] % size:
        return None
    return tuple(target), dim, True


def column_axis(input, weight, bias=None) -> int | None:
    """The mesh axis that alone splits the weight's rows (`out/a in`, plain or fused), else None.

    The input's features must be whole and its values complete; a bias must lie as the weight.
    """
    if not (isinstance(input, DTensor) and isinstance(weight, DTensor)) or weight.ndim != 2:
        return None
    mesh, last = weight.device_mesh, input.ndim - 1
    split = [m for m, p in enumerate(weight.placements) if not isinstance(p, Replicate)]
    if input.device_mesh != mesh or len(split) != 1 or not _splits(weight.placements[split[0]], 0):
        return None
    if any(isinstance(p, Partial) or _splits(p, last) for p in input.placements):
        return None
    if bias is not None and (not isinstance(bias, DTensor) or tuple(bias.placements) != tuple(weight.placements)):
        return None
    return split[0]


def _splits(p, dim: int) -> bool:
    return isinstance(p, (Shard, _StridedShard)) and p.dim == dim


def column_product(input, weight, bias, a: int, out: Placement):
    """Each rank's block of `F.linear` with the weight's rows split over axis a (see `column_axis`).

    The local product `x W_r^T` is the output's block on a as the weight's rows lie, which
    the caller names as `out` (`Shard(last)` for `out/a in`). NotImplemented when the
    tokens' layout does not fit the Megatron input paths of `column_parallel`.
    """
    mesh = weight.device_mesh
    tokens, group = input.placements[a], mesh.get_group(a)
    if isinstance(tokens, Replicate):
        step, make = "f", lambda: _ReduceGradient.apply(local_block(input), group)
    elif isinstance(tokens, Shard) and input.shape[tokens.dim] % mesh.size(a) == 0:
        step, make = "gather", lambda: _Gather.apply(local_block(input), tokens.dim, group)
    else:
        return NotImplemented
    # rows split over other axes (data parallel): parameter gradients are pending sums there
    rows = [m for m, p in enumerate(input.placements) if isinstance(p, (Shard, _StridedShard)) and m != a]
    local_w, local_b = local_block(weight, rows), local_block(bias, rows) if bias is not None else None
    if _pipelines(mesh, a) and getattr(input, _shared_name(step, a), None) is None:
        # the first linear to read the input gathers it chunk by chunk (hp.ops.pipelined_linear)
        dim = tokens.dim if step == "gather" else _cut_dim(input)
        prepared, out_local = pipelined_linear.column(local_block(input), local_w, local_b, dim, group,
                                                      gather=step == "gather")
        setattr(input, _shared_name(step, a), prepared)
    else:
        out_local = F.linear(_shared(input, step, a, make), local_w, local_b)
    placements = list(input.placements)
    placements[a] = out
    return to_dtensor(out_local, mesh, placements, (*input.shape[:-1], weight.shape[0]))


def linear_2d(input, weight, bias=None):
    """`F.linear` for the 2D layouts of the module docstring; NotImplemented otherwise."""
    plan = _plan(input, weight, bias)
    if plan is None:
        return NotImplemented
    mesh, o, i, token_dim, z_axes = plan
    gathered = _shared(
        input, "gather", o, lambda: _Gather.apply(local_block(input), token_dim, mesh.get_group(o))
    )
    local_bias = local_block(bias, z_axes) if isinstance(bias, DTensor) else None
    out = _MatmulScatter.apply(
        gathered, local_block(weight, z_axes), local_bias, token_dim, mesh.get_group(i)
    )
    placements = [Replicate()] * mesh.ndim
    for z in z_axes:
        placements[z] = input.placements[z]
    placements[i], placements[o] = Shard(token_dim), Shard(input.ndim - 1)
    return to_dtensor(out, mesh, placements, (*input.shape[:-1], weight.shape[0]))


def _plan(input, weight, bias):
    """(mesh, o, i, token dim, the axes that split only tokens) for the 2D pattern, else None."""
    if not (isinstance(input, DTensor) and isinstance(weight, DTensor)) or weight.ndim != 2:
        return None
    mesh = weight.device_mesh
    if input.device_mesh != mesh:
        return None
    w_axes = {m: p for m, p in enumerate(weight.placements) if not isinstance(p, Replicate)}
    if sorted(p.dim for p in w_axes.values() if isinstance(p, Shard)) != [0, 1] or len(w_axes) != 2:
        return None
    o = next(m for m, p in w_axes.items() if p.dim == 0)
    i = next(m for m, p in w_axes.items() if p.dim == 1)
    last = input.ndim - 1
    x = input.placements
    if not isinstance(x[i], Shard) or x[i].dim != last or not isinstance(x[o], Shard) or x[o].dim == last:
        return None
    token_dim = x[o].dim
    z_axes = [m for m, p in enumerate(x) if m not in (o, i) and p == Shard(token_dim)]
    # other token dims may be split too (the sequence over cp): each rank's block goes through as it is
    carried = [m for m, p in enumerate(x) if m not in (o, i) and isinstance(p, Shard) and p.dim not in (token_dim, last)]
    if any(not isinstance(p, Replicate) for m, p in enumerate(x) if m not in (o, i, *z_axes, *carried)):
        return None
    if any(z > min(o, i) for z in z_axes):  # tokens/z/o needs z before o and i in the mesh
        return None
    # the rows split over z and o before the product, over z and i after it
    rows = input.shape[token_dim] // math.prod([mesh.size(z) for z in z_axes])  # a list: dynamo traces no generator into C
    if rows * math.prod([mesh.size(z) for z in z_axes]) != input.shape[token_dim] or rows % mesh.size(o) \
            or rows % mesh.size(i) or weight.shape[0] % mesh.size(o):
        return None
    if bias is not None and (
        not isinstance(bias, DTensor) or bias.placements[o] != Shard(0)
        or any(not isinstance(p, Replicate) for m, p in enumerate(bias.placements) if m != o)
    ):
        return None
    return mesh, o, i, token_dim, sorted(z_axes + carried)


_KERNELS = (linear_2d, linear_summa, column_parallel, blockwise_linear)  # in `linear`'s order of preference
_SIGNATURES = 4096  # chosen kernels kept per mesh

"""2D tensor-parallel linear: weight split over two mesh axes, tokens over both.

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

Tokens may also be split over further mesh axes that come before o and i in
the mesh (`tokens/z/o`, the token-sharded 3D variant): the weight is then
replicated over z, and its gradient is left as a pending sum over z
(`+z`), reduced where the training step reduces gradients (as data
parallelism does).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(t.contiguous(), dim, group))


def _scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(t.contiguous(), "sum", dim, group))


class _GatherTokens(torch.autograd.Function):
    """All-gather over a mesh axis forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, local, dim: int, group):
        ctx.dim, ctx.group = dim, group
        return _gather(local, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, ctx.dim, ctx.group), None, None


class _MatmulScatter(torch.autograd.Function):
    """Local block product, partial sums reduce-scattered over a mesh axis along tokens."""

    @staticmethod
    def forward(ctx, gathered, weight, bias, dim: int, group):
        ctx.save_for_backward(gathered, weight)
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        out = _scatter(gathered @ weight.t(), dim, group)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad_all = _gather(grad, ctx.dim, ctx.group)  # every token's output gradient
        grad_in = grad_all @ weight  # partial over the other axis: its gather's backward sums it
        flat_grad, flat_in = grad_all.flatten(0, -2), gathered.flatten(0, -2)
        grad_w = flat_grad.t() @ flat_in
        grad_b = flat_grad.sum(0) if ctx.has_bias else None
        return grad_in, grad_w, grad_b, None, None


# id(input) -> (weak ref to input, axis, gathered local input): shared by the linears that
# read one input (tensors compare elementwise, so a WeakKeyDictionary cannot key them).
_GATHERED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _gathered_input(input: DTensor, token_dim: int, mesh, o: int) -> torch.Tensor:
    hit = _GATHERED.get(id(input))
    if hit is not None and hit[0]() is input and hit[1] == o:
        return hit[2]
    for key in [k for k, (ref, _, _) in _GATHERED.items() if ref() is None]:
        del _GATHERED[key]
    gathered = _GatherTokens.apply(input.to_local(), token_dim, mesh.get_group(o))
    _GATHERED[id(input)] = (weakref.ref(input), o, gathered)
    return gathered


def linear_2d(input, weight, bias=None):
    """`F.linear` for the 2D layouts of the module docstring; NotImplemented otherwise."""
    plan = _plan(input, weight, bias)
    if plan is None:
        return NotImplemented
    mesh, o, i, token_dim, z_axes = plan
    gathered = _gathered_input(input, token_dim, mesh, o)
    local_bias = _local(bias, z_axes) if isinstance(bias, DTensor) else None
    out = _MatmulScatter.apply(
        gathered, _local(weight, z_axes), local_bias, token_dim, mesh.get_group(i)
    )
    placements = [Replicate()] * mesh.ndim
    for z in z_axes:
        placements[z] = Shard(token_dim)
    placements[i], placements[o] = Shard(token_dim), Shard(input.ndim - 1)
    shape = (*input.shape[:-1], weight.shape[0])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)


def _local(param: DTensor, z_axes: list[int]) -> torch.Tensor:
    """The local block; its gradient is a pending sum over the token axes z."""
    grads = [Partial() if m in z_axes else p for m, p in enumerate(param.placements)]
    return param.to_local(grad_placements=grads)


def _plan(input, weight, bias):
    """(mesh, o, i, token dim, token-only axes) for the 2D pattern, else None."""
    if not (isinstance(input, DTensor) and isinstance(weight, DTensor)) or weight.ndim != 2:
        return None
    mesh = weight.device_mesh
    if input.device_mesh != mesh:
        return None
    w_axes = {m: p for m, p in enumerate(weight.placements) if not isinstance(p, Replicate)}
    if sorted(p.dim for p in w_axes.values() if type(p) is Shard) != [0, 1] or len(w_axes) != 2:
        return None
    o = next(m for m, p in w_axes.items() if p.dim == 0)
    i = next(m for m, p in w_axes.items() if p.dim == 1)
    last = input.ndim - 1
    x = input.placements
    if type(x[i]) is not Shard or x[i].dim != last or type(x[o]) is not Shard or x[o].dim == last:
        return None
    token_dim = x[o].dim
    z_axes = [m for m, p in enumerate(x) if m not in (o, i) and p == Shard(token_dim)]
    if any(not isinstance(p, Replicate) for m, p in enumerate(x) if m not in (o, i, *z_axes)):
        return None
    if any(z > min(o, i) for z in z_axes):  # tokens/z/o needs z before o and i in the mesh
        return None
    splits = mesh.size(o) * mesh.size(i) * math.prod(mesh.size(z) for z in z_axes)
    if input.shape[token_dim] % splits or weight.shape[0] % mesh.size(o):
        return None
    if bias is not None and (
        not isinstance(bias, DTensor) or bias.placements[o] != Shard(0)
        or any(not isinstance(p, Replicate) for m, p in enumerate(bias.placements) if m != o)
    ):
        return None
    return mesh, o, i, token_dim, z_axes

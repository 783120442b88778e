"""Row-wise functions (norms, RoPE) on each rank's block, without DTensor's per-op cost.

An RMSNorm or a rotary embedding mixes values only along its input's last
dim. Wherever that dim is whole, each rank's block of the result is the
function of its blocks, so the function can run once on plain tensors
instead of as a chain of DTensor ops, each paying a sharding propagation
(the bulk of a laid-out step's host time when kernels are small).
`blockwise(fn, like)` wraps such a function: it runs `fn` on the blocks of
its DTensor arguments and of the parameters it reads, and hands results
back laid out as the arguments `like` names.

It runs blockwise only where that is exact, decided once per call signature:

- every DTensor is on one mesh, none holds a pending sum, none is split
  along its last dim;
- each dim (counted from the right, as broadcasting aligns them) is split
  by the same mesh axes in every argument that splits it, and each axis
  splits the same dim wherever it splits one;
- the parameters it reads are replicated (their gradients then pend over
  the axes that split the arguments), and the arguments are not split by
  the batch alone: FSDP frees its gathered weights after forward, and
  saved as plain blocks they are taken for activations by `hp.offload`;
- on the first call of a signature, each result's block has the shape of
  its `like` argument's block (a plain tensor whole on every rank would
  otherwise broadcast against a split dim unnoticed).

The parameters it reads are turned into blocks by a torch-function mode; a
function that read no DTensor besides its arguments when planned (RoPE) runs
with no mode at all, each op a plain one (and anew on the DTensors should a
later call read one).

The last dim may be split too, over one mesh axis (2D tensor parallel
splits the residual stream's features): then `fn` may only run elementwise
ops and take means or sums over that dim, which become each rank's partial
sums all-reduced over the axis (forward and backward: one number per row
each way, where DTensor would move whole activations in backward). A
parameter it reads is cut to the rank's slice of that dim. Any other op
(a layer norm's fused kernel, a softmax) leaves the function to DTensor.

Otherwise, and under `torch.compile` (which traces DTensor ops into one
graph anyway), `fn` runs on the DTensors as before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.overrides import TorchFunctionMode

from hp.ops.collectives import all_reduce
from hp.ops.local import local_block, to_dtensor
from hp.watch import run_kernel


def blockwise(fn: Callable, like: Sequence[int] = (0,)) -> Callable:
    """`fn`, run on each rank's blocks where that is exact (module docstring).

    `fn` mixes values only along its inputs' last dim; its i-th result is laid out as its
    positional argument `like[i]` (one result when `like` has one entry).

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> unit = blockwise(lambda x: x / x.norm(dim=-1, keepdim=True))
    >>> with LocalTensorMode(2), hp.region():
    ...     y = unit(hp.shard(torch.ones(4, 2), "b/tp h", mesh))
    ...     print(hp.describe(y), round(y.full_tensor()[0, 0].item(), 4))
    f32[4/tp, 2] 0.7071
    """
    plans: dict = {}

    def on_blocks(args, kwargs, plan):
        (mesh, pending, batch_only, reads, features), wraps = plan
        try:
            out = _results(_run(fn, _Blocks(mesh, pending, batch_only, features), args, kwargs) if reads
                           else _run_plain(fn, args, kwargs))
        except _NotBlockwise:  # a parameter unlike those of the call that made the plan
            return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # hp's own bookkeeping: no mode needs to see it
            wrapped = tuple(to_dtensor(o, mesh, placements, shape, stride=stride)
                            for o, (placements, shape, stride) in zip(out, wraps))
        return wrapped[0] if len(like) == 1 else wrapped

    on_blocks.__name__ = f"blockwise {function_name(fn)}"

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling() or not any(isinstance(a, DTensor) for a in args):
            return fn(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # the signature's reads need no mode either
            key = _signature(args, kwargs)
        plan = plans.get(key, None) if key is not None else False
        if plan is None:
            if len(plans) >= _PLANS_PER_FUNCTION:
                plans.clear()
            plan = plans[key] = _plan(fn, like, args, kwargs)
        if plan is False:
            return fn(*args, **kwargs)
        return run_kernel(on_blocks, (args, kwargs, plan), {})

    run.hp_blockwise = fn
    run.__name__ = run.__qualname__ = function_name(fn)  # wraps finds no name on a hub-kernel module
    return run


_PLANS_PER_FUNCTION = 1024


def _plan(fn, like: Sequence[int], args: tuple, kwargs: dict):
    """How results of this signature are laid out, or False where running on blocks is not exact.

    A plan is ((mesh, pending axes, batch-only, reads parameters, the axis splitting the last dim or
    None), ((placements, shape, stride) per result)). A function that reads no DTensor besides its
    arguments (RoPE) runs with no mode at all.
    """
    tensors = [a for a in args if isinstance(a, DTensor)]
    if max(like) >= len(args) or not all(isinstance(args[i], DTensor) for i in like):
        return False
    mesh = tensors[0].device_mesh
    by_dim: dict[int, tuple[int, ...]] = {}  # aligned dim -> the axes that split it
    by_axis: dict[int, int] = {}  # axis -> the aligned dim it splits
    for t in tensors:
        if t.device_mesh != mesh:
            return False
        splits: dict[int, list[int]] = {}
        for m, p in enumerate(t.placements):
            if not isinstance(p, (Replicate, Shard)):  # a pending sum, a strided shard
                return False
            if isinstance(p, Shard):
                splits.setdefault(p.dim - t.ndim, []).append(m)
        for dim, axes in splits.items():
            if by_dim.setdefault(dim, tuple(axes)) != tuple(axes):
                return False
            if any(by_axis.setdefault(m, dim) != dim for m in axes):
                return False
    features = by_dim.get(-1, ())
    if len(features) > 1:
        return False
    features = features[0] if features else None
    pending = tuple(sorted(m for dim, axes in by_dim.items() for m in axes if dim != -1))
    batch_only = all(dim == -args[like[0]].ndim for dim in by_dim)
    blocks = _Blocks(mesh, pending, batch_only, features, trial=True)
    try:  # the trial run: does each result's block have its argument's block's shape?
        with torch.no_grad():
            out = _results(_run(fn, blocks, args, kwargs))
    except (_NotBlockwise, RuntimeError):
        return False
    wraps = []
    for o, i in zip(out, like):
        if not isinstance(o, torch.Tensor) or isinstance(o, DTensor) or o.shape != args[i]._local_tensor.shape:
            return False
        placements = tuple(args[i].placements)
        stride = o.stride() if mesh.size() == 1 else compute_global_tensor_info(o, mesh, placements)[1]
        wraps.append((placements, tuple(args[i].shape), tuple(stride)))
    if len(out) != len(like):
        return False
    return (mesh, pending, batch_only, blocks.read or features is not None, features), tuple(wraps)


def _run(fn, blocks: _Blocks, args: tuple, kwargs: dict):
    """`fn` on the blocks of its DTensor arguments and of the parameters it reads; results plain."""
    with torch._C.DisableTorchFunction():
        local_args = _blocks_of(args)
    with blocks:
        return fn(*local_args, **kwargs)


def _run_plain(fn, args: tuple, kwargs: dict):
    """`fn` on the blocks of its DTensor arguments, no torch function seen on the way (it read no
    other DTensor when planned; one it reads now would come back laid out: run it anew then)."""
    with torch._C.DisableTorchFunction():
        out = fn(*_blocks_of(args), **kwargs)
    if any(isinstance(o, DTensor) for o in _results(out)):
        raise _NotBlockwise
    return out


def _blocks_of(args: tuple) -> list:
    return [local_block(a) if isinstance(a, DTensor) else a for a in args]


def _results(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _signature(args: tuple, kwargs: dict):
    """What decides the plan: each tensor's mesh, layout, shape, stride and dtype, other arguments' values.

    A mesh by identity: an equal mesh of another (since destroyed) world must not lend its
    process groups, and the plan holds the mesh, so its id is not reused while cached.

    None where that is no key: symbolic sizes, a tensor passed by keyword, an unhashable value.
    """
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    key = tuple(
        (id(a.device_mesh), tuple(a.placements), a.shape, a.stride(), a.dtype) if isinstance(a, DTensor)
        else (a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
        for a in args
    ) + tuple(sorted(kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _NotBlockwise(Exception):
    """A parameter that `fn` reads cannot be used as its block."""


class _Blocks(TorchFunctionMode):
    """Inside `fn`: the DTensors it reads besides its arguments (parameters) as their blocks; with the
    last dim split over mesh axis `features`, that dim's means and sums over the whole of it."""

    def __init__(self, mesh, pending: tuple[int, ...], batch_only: bool, features: int | None = None,
                 trial: bool = False):
        super().__init__()
        self.mesh, self.pending, self.batch_only, self.features = mesh, pending, batch_only, features
        self.trial = trial  # a trial run learns shapes: its sums need not move
        self.read = False  # whether `fn` read a DTensor besides its arguments

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name != "__get__":
            args = tuple(self._block(a) for a in args)
            kwargs = {k: self._block(v) for k, v in kwargs.items()}
        if self.features is not None and name != "__get__":
            return self._over_split_features(func, name, args, kwargs)
        with torch._C.DisableTorchFunction():  # all plain now: the region has nothing to convert
            return func(*args, **kwargs)

    def _over_split_features(self, func, name: str, args: tuple, kwargs: dict):
        """`func` on a block whose last dim is split over `features`: elementwise as it is; a mean or sum
        over that dim from the partial sums, all-reduced; anything else is not blockwise."""
        with torch._C.DisableTorchFunction():
            if name in ("mean", "sum") and _last_dim_only(args, kwargs):
                x, keep = args[0], kwargs.get("keepdim", args[2] if len(args) > 2 else False)
                total = x.sum(-1, keepdim=keep)
                total = total if self.trial else _SumOver.apply(total, self.mesh.get_group(self.features))
                return total / (x.shape[-1] * self.mesh.size(self.features)) if name == "mean" else total
            if name not in _ELEMENTWISE:
                raise _NotBlockwise
            return func(*args, **kwargs)

    def _block(self, value):
        if not isinstance(value, DTensor):
            return value
        if value.device_mesh != self.mesh or not all(isinstance(p, Replicate) for p in value.placements):
            raise _NotBlockwise
        if self.batch_only and self.pending and value.requires_grad:
            raise _NotBlockwise
        self.read = True
        if self.features is None:
            return local_block(value, self.pending)
        # the rank's slice of the last dim: its gradient, zero elsewhere, is summed over the axis
        whole = local_block(value, (*self.pending, self.features))
        size = whole.shape[-1] // self.mesh.size(self.features)
        return whole.index_select(-1, _slice(self.mesh.get_local_rank(self.features), size, whole.device))


# What a function may run on a block whose last dim is split: ops of one element at a time.
_ELEMENTWISE = frozenset({
    "to", "float", "type_as", "contiguous", "pow", "__pow__", "rsqrt", "sqrt", "exp", "neg", "__neg__", "mul",
    "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "div", "__truediv__",
    "__rtruediv__", "clamp", "clamp_min",
})


def _last_dim_only(args: tuple, kwargs: dict) -> bool:
    """Whether a mean / sum call reduces the last dim alone."""
    x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return dim is not None and len(dims) == 1 and dims[0] in (-1, x.ndim - 1) and "dtype" not in kwargs


class _SumOver(torch.autograd.Function):
    """Partial sums all-reduced over a mesh axis; their gradients too (each rank's share is partial)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(partial, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, "sum", ctx.group), None


@maybe_run_for_local_tensor  # rank-dependent: one slice per simulated rank
def _slice(coordinate: int, size: int, device) -> torch.Tensor:
    return torch.arange(coordinate * size, (coordinate + 1) * size, device=device)


def function_name(fn: Callable) -> str:
    """`fn`'s name; a function that transformers wraps as a module for hub kernels (`kernels`' `Func`, which
    calls it from its forward) is named by the function it wraps.

    >>> from transformers.models.llama import modeling_llama
    >>> function_name(modeling_llama.apply_rotary_pos_emb), function_name(lambda x: x)
    ('apply_rotary_pos_emb', '<lambda>')
    """
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is not None:
        return name
    cells = getattr(getattr(type(fn), "forward", None), "__closure__", None) or ()
    inner = next((c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)), None)
    return inner.__name__ if inner is not None else type(fn).__name__

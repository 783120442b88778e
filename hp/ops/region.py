"""`hp.region()`: where plain tensors meet DTensors, and algorithmic kernels are chosen.

Model code mixes DTensors with plain tensors it makes itself (RoPE's cos and
sin, masks, position ids). Inside a region, every torch function that gets
both treats the plain tensors as replicated on the DTensors' mesh, the way
JAX treats unannotated arrays. The conversion happens at the torch-function
level, so autograd records DTensor ops only and the backward pass needs no
region. A region also routes a few functions to distributed kernels when
their inputs are laid out for them (cross-entropy on vocab-split logits),
and turns DTensor's "no sharding strategy" failure into an `hp.RuleError`
that names the op, the input layouts, the source line and how to add a rule.
`hp.parallelize` runs a model's forward inside a region.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hp.layouts import describe
from hp.ops import batch_dims, flatten, fused, masked, npu_attention, residual, selection
from hp.ops.context_parallel import sequence_parallel_attention
from hp.ops.cross_entropy import vocab_parallel_cross_entropy
from hp.ops.embedding import vocab_parallel_embedding
from hp.ops.linear import linear
from hp.ops.pad import blockwise_pad
from hp.ops.local import to_dtensor
from hp.ops.rule import RuleError
from hp.source import user_line
from hp.watch import run_kernel


def in_turn(*kernels, name: str | None = None):
    """One kernel (called `name`, else as the first) that tries `kernels` in order: the first that
    applies wins.

    >>> in_turn(lambda x: NotImplemented, lambda x: x + 1)(1)
    2
    """

    def first_applicable(*args, **kwargs):
        for kernel in kernels:
            out = kernel(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return NotImplemented

    first_applicable.__name__ = name or kernels[0].__name__
    return first_applicable


# Functions whose DTensor inputs select an algorithm of hp's own (NotImplemented: not applicable).
KERNELS = {
    torch.nn.functional.cross_entropy: vocab_parallel_cross_entropy,
    torch.nn.functional.embedding: vocab_parallel_embedding,
    torch.nn.functional.linear: in_turn(linear, fused.fused_linear),
    torch.nn.functional.scaled_dot_product_attention: in_turn(
        sequence_parallel_attention, batch_dims.blockwise_attention, name="attention"
    ),
    torch.nn.functional.pad: blockwise_pad,
    **fused.SLICES,
    torch.Tensor.__getitem__: in_turn(fused.fused_getitem, masked.masked_getitem),
    torch.Tensor.__setitem__: masked.masked_setitem,
    torch.Tensor.masked_scatter: masked.masked_scatter,
    **residual.KERNELS,
    **flatten.KERNELS,
    **dict.fromkeys([torch.Tensor.view, torch.Tensor.reshape],
                    in_turn(flatten.flatten_split_leading, flatten.unflatten_strided_leading, name="view")),
    **batch_dims.KERNELS,
    **npu_attention.kernels(),
    **selection.kernels(),
}
_NO_STRATEGY = re.compile(r"Operator (\S+) does not have a sharding strategy registered")
_PROPAGATION_FAILED = re.compile(r"Sharding propagation failed for ([\w.]+)\(")


class region(TorchFunctionMode):
    """Run model code whose tensors are partly DTensors.

    >>> import hp, torch
    >>> from torch.distributed._local_tensor import LocalTensorMode
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with LocalTensorMode(2), hp.region():
    ...     x = hp.shard(torch.ones(4, 6), "b h/tp", mesh)
    ...     y = x * torch.arange(6.0)          # a plain tensor, taken as replicated
    ...     print(hp.describe(y))
    f32[4, 6/tp]
    """

    def __enter__(self):
        # Decompositions below the torch-function level (SDPA's math path builds its
        # causal mask as a plain tensor) mix tensors at dispatch: replicate those too.
        self._dispatch_level = implicit_replication()
        self._dispatch_level.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._dispatch_level.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__":  # attribute reads mix nothing
            return func(*args, **kwargs)
        # DTensor opts out of __torch_function__, so `types` never names it: look at the args.
        mesh, mixed = _mesh_of(args, kwargs)
        if mesh is None:
            return func(*args, **kwargs)
        kernel = KERNELS.get(func)
        if kernel is not None:
            result = run_kernel(kernel, args, kwargs)
            if result is not NotImplemented:
                return result
        if mixed:
            args, kwargs = _replicated(args, mesh), {k: _replicated(v, mesh) for k, v in kwargs.items()}
        try:
            return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            missing = _NO_STRATEGY.search(str(e))
            if missing is not None:
                raise _no_rule_error(missing.group(1), func, args, kwargs) from None
            failed = _PROPAGATION_FAILED.search(str(e))
            if failed is not None:
                raise _layout_error(failed.group(1), str(e), func, args, kwargs) from None
            raise


def _mesh_of(args: tuple, kwargs: dict):
    """(the mesh of the call's first DTensor or None, whether a plain tensor is there too).

    Torch functions take tensors as arguments or in one list (`torch.cat`): no deeper walk,
    since this runs for every op of a model's forward.
    """
    mesh, plain = None, False
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if isinstance(a, DTensor):
                mesh = mesh or a.device_mesh
            else:
                plain = True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, DTensor):
                    mesh = mesh or t.device_mesh
                elif isinstance(t, torch.Tensor):
                    plain = True
    return mesh, plain


def _replicated(value, mesh):
    """`value` (an argument) with plain tensors, alone or in a list, as replicated DTensors."""
    if isinstance(value, (list, tuple)):
        return type(value)(_replicated(v, mesh) for v in value) if not hasattr(value, "_fields") else value
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    return to_dtensor(value, mesh, (Replicate(),) * mesh.ndim, value.shape, stride=value.stride())


def _where(func, args, kwargs) -> tuple[str, str]:
    """(inputs as layouts, 'called through F at FILE:LINE') for an error message."""
    flat, _ = tree_flatten((args, kwargs))
    layouts = ", ".join(describe(a) for a in flat if isinstance(a, DTensor))
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    return layouts, f"called through {name} at {user_line()}"


def _layout_error(op: str, message: str, func, args, kwargs) -> RuleError:
    layouts, where = _where(func, args, kwargs)
    reason = next((line.strip() for line in message.splitlines() if line.strip()), message)
    return RuleError(
        f"{op} cannot run on inputs {layouts} ({where}): {reason}\n"
        "Constrain the inputs to a layout this op accepts (hp.constrain), or change the plan."
    )


def _no_rule_error(op: str, func, args, kwargs) -> RuleError:
    layouts, where = _where(func, args, kwargs)
    return RuleError(
        f"no sharding rule for {op} ({where}) with inputs {layouts}.\n"
        f"Register one with hp.rule(torch.ops.{op}, \"<dims of each tensor argument> -> "
        "<dims of each result>\", sum=..., whole=...); see docs/extending.md, 'Adding a rule'."
    )

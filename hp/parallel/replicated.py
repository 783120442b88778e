"""`hp.run_replicated`: a module computed whole on every rank, on local tensors.

A vision-language model's vision tower is replicated: every rank of the
decoder's mesh encodes the same images with the same weights. Running it on
DTensors buys nothing, and costs more than host overhead: the tower's output
is split by data or context parallel at the decoder's input, so the
gradient that comes back is each rank's part of a sum, and DTensor resolves
such a pending sum (an all-reduce) at the tower's first nonlinear backward,
which leaves the tower's parameter gradients whole on every rank. FSDP
sums those over dp and cp once more, so they would count once per rank.

So the module runs as JAX's `shard_map` runs a function: its DTensor
parameters (replicated) enter as their local values, the computation is
plain torch, and its tensor outputs leave as replicated DTensors. The
gradient is declared where the module meets the mesh: at the outputs it
is brought to a pending sum over `pending` axes (each rank's part; an
already whole gradient is kept by the first rank of each group) and whole
over the others, and the parameters' gradients pend over the same axes,
resolved once with every other gradient (`hp.reduce_gradients`, or FSDP's
reduce-scatter). The module must be replicated over the `pending` axes; a
tower laid out over the others (tp) computes there as DTensors on the
submesh of those axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from hp.layouts import describe
from hp.layouts.reshard import reshard
from hp.parallel.parallelize import PlanError, forward_inside


def run_replicated(module: nn.Module, mesh, pending: Sequence[str] = ()) -> nn.Module:
    """Run `module`'s forward on each rank's local values; its gradients pend over the mesh axes `pending`.

    Parameters replicated over the whole mesh enter as plain tensors. Parameters laid out over
    other axes than `pending` (a tensor-parallel tower) enter as DTensors on the mesh of those
    axes, so the module computes as any laid-out module does, on that smaller mesh.

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     lin = hp.parallelize(torch.nn.Linear(3, 2), mesh, {})
    ...     lin = hp.run_replicated(lin, mesh, pending=("dp",))
    ...     y = lin(torch.ones(4, 3))
    ...     hp.constrain(y, "b/dp h", pending_grad=True).sum().backward()
    ...     print(hp.describe(y), hp.describe(lin.weight.grad))
    f32[4, 2] f32[2, 3] +dp
    """
    names = mesh.mesh_dim_names
    unknown = sorted(set(pending) - set(names))
    if unknown:
        raise PlanError(f"hp.run_replicated: pending axes {unknown} are not axes of the mesh {names}")
    dims = frozenset(names.index(a) for a in pending)
    kept = tuple(n for n in names if n not in pending)
    submesh = mesh[kept] if dims and kept else mesh
    forward_inside(module, lambda: _Local(mesh, dims, submesh, type(module).__name__))

    def whole(mod, args, out):
        return tree_map_only(torch.Tensor, lambda t: _Whole.apply(t, mesh, dims), out)

    module.register_forward_hook(whole)
    return module


class _Local(TorchFunctionMode):
    """Every DTensor argument enters as its local value (on `submesh` where it is laid out there), its
    gradient declared pending over the mesh dims `dims`."""

    def __init__(self, mesh, dims: frozenset[int], submesh, where: str):
        super().__init__()
        self.mesh, self.dims, self.submesh, self.where = mesh, dims, submesh, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) != "__get__":  # attribute reads compute nothing
            args = tuple(self._argument(a) for a in args)
            kwargs = {k: self._argument(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _argument(self, value):
        """One level deep, as `hp.region` looks: a tensor, or tensors in one list (`torch.cat`)."""
        if isinstance(value, DTensor):
            return self._local(value)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._local(v) if isinstance(v, DTensor) else v for v in value)
        return value

    def _local(self, t: DTensor):
        if t.device_mesh != self.mesh:
            return t  # already on the submesh
        laid_out = [m for m, p in enumerate(t.placements) if not p.is_replicate()]
        if any(m in self.dims for m in laid_out):
            raise PlanError(f"hp.run_replicated: {self.where} runs whole on every rank of the axes its gradients "
                            f"pend over, but one of its tensors is laid out {describe(t)} over them")
        if laid_out and self.submesh is self.mesh:
            return t
        local = t.to_local(grad_placements=[Partial() if m in self.dims else p for m, p in enumerate(t.placements)])
        if not laid_out:
            return local
        kept = [p for m, p in enumerate(t.placements) if m not in self.dims]
        return DTensor.from_local(local, self.submesh, kept, run_check=False, shape=t.shape, stride=t.stride())


class _Whole(torch.autograd.Function):
    """An output (plain, or on the submesh) as a DTensor replicated over the pending dims; its gradient
    comes back as a pending sum over those dims, laid out as the output was over the others."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, dims: frozenset[int]) -> DTensor:
        ctx.submesh = t.device_mesh if isinstance(t, DTensor) else None
        own = iter(t.placements if ctx.submesh is not None else ())
        placements = [Replicate() if m in dims or ctx.submesh is None else next(own) for m in range(mesh.ndim)]
        ctx.target = [Partial() if m in dims else p for m, p in enumerate(placements)]
        ctx.dims = dims
        local = t.to_local() if ctx.submesh is not None else t
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())

    @staticmethod
    def backward(ctx, grad: DTensor):
        local = reshard(grad, ctx.target).to_local()
        if ctx.submesh is None:
            return local, None, None
        own = [p for m, p in enumerate(ctx.target) if m not in ctx.dims]
        return DTensor.from_local(local, ctx.submesh, own, run_check=False, shape=grad.shape,
                                  stride=grad.stride()), None, None

"""`hp.run_replicated`: a module computed whole on every rank, on plain tensors.

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
reduce-scatter). The module must be replicated over the whole mesh.
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
from hp.parallelize import PlanError, forward_inside


def run_replicated(module: nn.Module, mesh, pending: Sequence[str] = ()) -> nn.Module:
    """Run `module`'s forward on plain local tensors; its gradients pend over the mesh axes `pending`.

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
    grad_placements = tuple(Partial() if name in pending else Replicate() for name in names)
    forward_inside(module, lambda: _Plain(grad_placements, type(module).__name__))

    def as_replicated(mod, args, out):
        return tree_map_only(torch.Tensor, lambda t: _Whole.apply(t, mesh, grad_placements), out)

    module.register_forward_hook(as_replicated)
    return module


class _Plain(TorchFunctionMode):
    """Every DTensor argument enters as its local value, its gradient declared `grad_placements`."""

    def __init__(self, grad_placements: tuple, where: str):
        super().__init__()
        self.grad_placements, self.where = grad_placements, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) != "__get__":  # attribute reads compute nothing
            args, kwargs = tree_map_only(DTensor, self._local, (args, kwargs))
        return func(*args, **kwargs)

    def _local(self, t: DTensor) -> torch.Tensor:
        if not all(p.is_replicate() for p in t.placements):
            raise PlanError(f"hp.run_replicated: {self.where} runs whole on every rank, but one of its tensors is "
                            f"laid out {describe(t)}; leave its parameters out of the tensor-parallel plan")
        return t.to_local(grad_placements=self.grad_placements)


class _Whole(torch.autograd.Function):
    """A rank's plain output as a replicated DTensor; its gradient comes back laid out `grad_placements`."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, grad_placements: tuple) -> DTensor:
        ctx.grad_placements = grad_placements
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return reshard(grad, ctx.grad_placements).to_local(), None, None

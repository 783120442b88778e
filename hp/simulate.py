"""`hp.simulated(mesh)`: compute every rank's values in one process, with hp still watching.

It enters `LocalTensorMode` over the mesh's ranks. A diagnostic entered
before it (a `hp.comm.trace()`, `hp.explain`, `hp.strict`) watches through a
dispatch mode that would sit below `LocalTensorMode` and see nothing, so
`simulated` puts a hub of `hp.watch` above it: the diagnostics then see the
same events wherever they were entered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh

from hp.watch import hub_on_top


@contextmanager
def simulated(mesh: DeviceMesh) -> Iterator[None]:
    """Run the block as all ranks of `mesh` at once (real values, one process).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.comm.trace() as t, hp.simulated(mesh):
    ...     y = hp.constrain(hp.shard(torch.ones(4, 2), "b/tp h", mesh), "b h")
    >>> t.count("all_gather")
    1
    """
    with LocalTensorMode(mesh.size()), hub_on_top():
        yield


def each_rank(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """`fn(*tensors)` on each rank's own tensors, differentiably; simply `fn(*tensors)` outside a simulation.

    Code with data-dependent control flow (a loop over the experts that got tokens) cannot run on
    simulated ranks at once, whose tensors differ in shape from rank to rank: under
    `hp.simulated`, each rank's call runs alone on its plain tensors, and backward does the same.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     x = hp.from_local(torch.ones(2), "b/tp", mesh).to_local()
    ...     y = each_rank(lambda t: t[t > 0] * 2, x)
    >>> y._local_tensors[1].tolist()
    [2.0, 2.0]
    """
    if enabled_local_tensor_mode() is None:
        return fn(*tensors)
    return _EachRank.apply(fn, *tensors)


class _EachRank(torch.autograd.Function):
    """One autograd graph per simulated rank, run forward and backward rank by rank."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        mode = enabled_local_tensor_mode()
        ctx.graphs, outputs = {}, {}
        # The ranks' graphs keep what they save: an activation checkpoint around the call recomputes
        # this node as a whole, never the graphs inside it.
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with mode.disable(), torch.enable_grad(), keep:
            for rank in mode.ranks:
                leaves = [_leaf(t, rank) for t in tensors]
                out = fn(*leaves)
                ctx.graphs[rank] = (out, leaves)
                outputs[rank] = out.detach()
        return LocalTensor(outputs)

    @staticmethod
    def backward(ctx, grad):
        mode = enabled_local_tensor_mode()
        grads: dict[int, list] = {}
        with mode.disable():
            for rank, (out, leaves) in ctx.graphs.items():
                wanted = [leaf for leaf in leaves if leaf.requires_grad]
                found = iter(torch.autograd.grad(out, wanted, grad._local_tensors[rank], allow_unused=True))
                grads[rank] = [_or_zeros(next(found), leaf) if leaf.requires_grad else None for leaf in leaves]
        ctx.graphs = None
        per_input = zip(*(grads[rank] for rank in sorted(grads)))
        return None, *(None if g[0] is None else LocalTensor(dict(zip(sorted(grads), g))) for g in per_input)


def _leaf(t: torch.Tensor, rank: int) -> torch.Tensor:
    local = t._local_tensors[rank] if isinstance(t, LocalTensor) else t
    return local.detach().requires_grad_(t.requires_grad and local.is_floating_point())


def _or_zeros(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if grad is None else grad

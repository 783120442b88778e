"""Data parallelism around layouts: FSDP2 on the dp axis, and the gradient reduction.

Without FSDP, the batch is laid out `b/dp` like any other tensor, parameters
are replicated over dp, and their gradients come back as pending sums over
dp (and cp): `reduce_gradients` resolves them where the training step wants,
before the optimizer. With FSDP, FSDP2 (`fully_shard`, one unit per decoder
block plus the root) shards the tensor-parallel blocks again over dp
(`64/tp/dp 64`) and reduce-scatters their gradients itself; each rank feeds
its own slice of the batch, which `fully_shard_model` cuts from the global
batch every rank passes, so both modes take the same inputs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hp.parallelize import parallelize
from hp.sequence import BATCHED, IGNORE_INDEX, as_keywords


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def fully_shard_model(model: nn.Module, mesh, blocks: list[nn.Module], params: dict, outputs: dict) -> None:
    """FSDP2 over dp around the tensor-parallel layout (applied on the mesh without dp).

    Every rank still passes the global batch (as with plain dp) and keeps its dp slice. The
    loss is summed over the global count of labelled tokens (HF's `num_items_in_batch`), so the
    dp ranks' losses add up to one device's; FSDP averages gradients over dp (gloo has no
    pre-scaled sum), so the loss's gradient is scaled by dp to make them a sum. The loss comes
    back as a DTensor pending a sum over dp (`loss.full_tensor()` is the global one).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate

    inner = tuple(name for name in mesh.mesh_dim_names if name != "dp")
    if inner:
        parallelize(model, mesh[inner], params, outputs=outputs)
    for unit in [*blocks, model]:
        fully_shard(unit, mesh=mesh["dp"], shard_placement_fn=_fsdp_dim)
    dp, dp_rank, signature = mesh.size(mesh.mesh_dim_names.index("dp")), mesh.get_local_rank("dp"), inspect.signature(model.forward)

    def before(mod, args, kwargs):
        kwargs = as_keywords(signature, args, kwargs)
        kwargs.setdefault("num_items_in_batch", _labelled_tokens(kwargs))
        for key in BATCHED:
            if kwargs.get(key) is None:
                continue
            if kwargs[key].shape[0] % dp:
                raise ValueError(f"{key} has batch {kwargs[key].shape[0]}, not divisible by dp={dp}")
            kwargs[key] = kwargs[key].chunk(dp)[dp_rank]
        return (), kwargs

    def after(mod, args, kwargs, out):
        if getattr(out, "loss", None) is not None:
            local = out.loss.to_local() if isinstance(out.loss, DTensor) else out.loss
            local = _ScaleGradient.apply(local, dp)  # FSDP averages over dp; the loss is a sum
            placements = [Partial() if n == "dp" else Replicate() for n in mesh.mesh_dim_names]
            out.loss = DTensor.from_local(local, mesh, placements, run_check=False)
        return out

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    model.register_forward_hook(after, with_kwargs=True)


def _fsdp_dim(param):
    """FSDP's dim for a parameter: 0, unless tp splits dim 0 in fused parts (FSDP cannot split those again)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(param, DTensor) and param.ndim > 1 and any(
        isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements
    ):
        return Shard(1)
    return None


def _labelled_tokens(kwargs: dict) -> int | None:
    """The global count of tokens with a label (after the shift), or None without labels."""
    if kwargs.get("shift_labels") is not None:  # already shifted (by hp.sequence)
        return int((kwargs["shift_labels"] != IGNORE_INDEX).sum())
    if kwargs.get("labels") is not None:
        return int((kwargs["labels"][:, 1:] != IGNORE_INDEX).sum())
    return None


def reduce_gradients(model: nn.Module) -> None:
    """Resolve the pending sums of parameter gradients (over dp and cp) into the parameters' layouts.

    The data-parallel gradient reduction, done where the step wants it (before the optimizer).

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     lin = hp.parallelize(torch.nn.Linear(4, 4), mesh, {}, inputs={"": "b/dp h"})
    ...     lin(torch.ones(2, 4)).sum().backward()
    ...     before = hp.describe(lin.weight.grad)
    ...     hp.reduce_gradients(lin)
    ...     print(before, "->", hp.describe(lin.weight.grad))
    f32[4, 4] +dp -> f32[4, 4]
    """
    from torch.distributed.tensor import DTensor, Partial

    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)

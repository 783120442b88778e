"""Data parallelism around layouts: FSDP2 over dp x cp, and the gradient reduction.

The batch is laid out `b/dp` (and the sequence `s/cp`) like any other tensor,
so parameter gradients come back as pending sums over dp and cp. Without
FSDP, parameters are replicated over dp and cp and `reduce_gradients`
resolves those sums where the training step wants, before the optimizer.
With FSDP, FSDP2 (`fully_shard`, one unit per decoder block plus the root)
shards the laid-out parameters again over the flattened dp x cp ranks
(`64/tp/dp_cp 64`, torchtitan's `dp_shard_cp`) and its reduce-scatter resolves
the pending sums itself; both modes take the same inputs and give the same
loss. Experts split over ep are their own FSDP units, sharded over the ranks
that hold the same experts (`Strategy.expert_fsdp_axes`: dp and cp, not ep).
"""

from __future__ import annotations

import torch
from torch import nn

from hp.compat import backports
from hp.compat.fsdp import fully_shard_on_axes
from hp.parallel import plain_dp
from hp.parallel.strategy import Strategy


def fully_shard_model(model: nn.Module, mesh, blocks: list[nn.Module], strategy: Strategy, *,
                      experts: list[nn.Module] = ()) -> None:
    """FSDP2 over `strategy.fsdp_axes` of `mesh`, around the layout `hp.parallelize` gave `model` on it.

    FSDP2 runs on the whole mesh (its `dp_mesh_dims`; `hp.compat.fsdp` where torch lacks
    it): parameters stay DTensors replicated over dp and cp and laid out over tp, and each
    gradient reaches FSDP still pending its sum over dp and cp, which FSDP keeps and resolves
    in its reduce-scatter over the flattened dp x cp ranks (redistributing only the tp part).
    So that reduce-scatter must sum, not average: each rank's part of the loss is already
    divided by the global count of labelled tokens, so the parts' gradients add up to one
    device's. Mixed precision applies to every
    unit; `reshard_after_forward` to the blocks, while the root keeps FSDP's own choice
    (gathered after forward: backward starts with it). `experts` modules are units of their
    own over `strategy.expert_fsdp_axes` (their gradients pend over those axes only); with no
    such axis they stay out of FSDP, laid out over ep, and `reduce_gradients` resolves them.
    With `mpmd` set, each block prefetches the next block's gather in forward and the previous
    block's in backward (FSDP2's explicit prefetching), so they fly while a block computes.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _onto(model, mesh)
    precision = MixedPrecisionPolicy(_dtype(strategy.param_dtype), _dtype(strategy.reduce_dtype))
    common = {"mp_policy": precision, "shard_placement_fn": _fsdp_dim}
    blocks_too = {**common, "reshard_after_forward": strategy.reshard_after_forward}
    units, ignored = [], set()
    for module in experts:
        if strategy.expert_fsdp_axes:
            units.append(_shard(module, mesh, strategy.expert_fsdp_axes, **blocks_too))
        else:
            ignored.update(module.parameters())
    units += [_shard(block, mesh, strategy.fsdp_axes, ignored_params=ignored, **blocks_too) for block in blocks]
    if strategy.mpmd is not None:  # under hp.mpmd each block's gather flies while its neighbour computes
        in_order = units[len(units) - len(blocks):]
        for before, after in zip(in_order, in_order[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    _summing([*units, _shard(model, mesh, strategy.fsdp_axes, ignored_params=ignored, **common)])


def fully_shard_plain(model: nn.Module, mesh, blocks: list[nn.Module], strategy: Strategy) -> None:
    """FSDP2 over dp alone around a model of plain parameters (`hp.parallel.plain_dp`'s rows per rank).

    torch's own arrangement: the sharded parameters are DTensors on the dp axis, and the gathered
    ones plain tensors, so no op of the step pays DTensor's dispatch. One unit per block plus the
    root; the reduce-scatter sums (each rank's loss is already over the global token count).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp = mesh["dp"]
    precision = MixedPrecisionPolicy(_dtype(strategy.param_dtype), _dtype(strategy.reduce_dtype))
    units = [fully_shard(block, mesh=dp, mp_policy=precision, reshard_after_forward=strategy.reshard_after_forward)
             for block in blocks]
    _summing([*units, fully_shard(model, mesh=dp, mp_policy=precision)])


def _summing(units: list) -> None:
    """FSDP units whose reduce-scatter sums: each rank's gradient is its part of a sum (its tokens over the
    global count, or a pending sum), not a per-rank mean."""
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-scaled one)


def _shard(module: nn.Module, mesh, axes: tuple[str, ...], *, ignored_params: set = frozenset(), **options):
    """FSDP2 over `axes` of the whole `mesh` (`dp_mesh_dims`, or its backport where torch lacks it)."""
    if not backports.fsdp_on_the_whole_mesh():
        return fully_shard_on_axes(module, mesh, axes, ignored_params=ignored_params, **options)
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    return fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=axes),
                       ignored_params=ignored_params or None, **options)


def _onto(model: nn.Module, mesh) -> None:
    """Put every parameter's DTensor on `mesh` itself, not on an equal mesh made earlier in the process.

    FSDP2 wants the very mesh object it is given, and DTensor's op cache can hand a new parameter
    (`nn.Parameter` detaches) the mesh of an earlier, equal layout: a second model laid out in one process.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    for param in model.parameters():
        if param.device_mesh is not mesh:
            param._spec = DTensorSpec(mesh, param.placements, tensor_meta=param._spec.tensor_meta)


def _dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a strategy names ("bfloat16"), or None (FSDP keeps the tensor's own)."""
    return None if name is None else getattr(torch, name)


def _fsdp_dim(param):
    """FSDP's dim for a parameter: 0, unless tp splits dim 0 in fused parts (FSDP cannot split those again)
    or ep splits packed experts along it (FSDP splits each expert's rows instead)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(param, DTensor) and param.ndim > 1 and any(
        (isinstance(p, _StridedShard) and p.dim == 0) or (param.ndim == 3 and p == Shard(0)) for p in param.placements
    ):
        return Shard(1)
    return None


def reduce_gradients(model: nn.Module) -> None:
    """Resolve the pending sums of parameter gradients (over dp and cp) into the parameters' layouts.

    The data-parallel gradient reduction, done where the step wants it (before the optimizer).
    Gradients that only wait for sums (the common case: split tokens, replicated weights) are
    summed together, a bucket of them laid end to end per collective, as DDP does: one
    all-reduce per axis instead of one per parameter. Others redistribute one by one.

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, simulate=True)
    >>> with hp.simulated(mesh):
    ...     lin = hp.parallelize(torch.nn.Linear(4, 4), mesh, {}, inputs={"": "b/dp h"})
    ...     lin(torch.ones(2, 4)).sum().backward()
    ...     before = hp.describe(lin.weight.grad)
    ...     with hp.comm.trace() as t:
    ...         hp.reduce_gradients(lin)
    ...     print(before, "->", hp.describe(lin.weight.grad), t.count("all_reduce"))
    f32[4, 4] +dp -> f32[4, 4] 1
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if plain_dp.finish(model):  # plain parameters: their sums started during backward
        return
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for param in model.parameters():
        grad = param.grad
        if not isinstance(grad, DTensor) or not any(isinstance(p, Partial) for p in grad.placements):
            continue
        if all(g == p or (isinstance(g, Partial) and p == Replicate()) for g, p in zip(grad.placements,
                                                                                       param.placements)) \
                and grad.is_contiguous():
            buckets.setdefault((grad.device_mesh, grad.placements, param.placements, grad.dtype), []).append(param)
        else:
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
    for (mesh, pending, placements, _), params in buckets.items():
        for bucket in _buckets(params):
            _sum_together(bucket, mesh, pending, placements)


BUCKET_ELEMENTS = 1 << 25  # gradient elements summed by one collective (128 MiB in fp32)


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` in runs of at most BUCKET_ELEMENTS local gradient elements (a larger one alone)."""
    runs, size = [[]], 0
    for param in params:
        n = param.grad.to_local().numel()
        if runs[-1] and size + n > BUCKET_ELEMENTS:
            runs.append([])
            size = 0
        runs[-1].append(param)
        size += n
    return runs


def _sum_together(params: list[nn.Parameter], mesh, pending, placements) -> None:
    """Resolve the pending sums of `params`' gradients (alike in layout) with one flat buffer."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    locals_ = [param.grad.to_local() for param in params]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    sums = [p if isinstance(p, Partial) else Replicate() for p in pending]  # only the pending axes move
    summed = DTensor.from_local(flat, mesh, sums, run_check=False).redistribute(mesh, [Replicate()] * mesh.ndim)
    summed = summed.to_local()
    offset = 0
    for param, local in zip(params, locals_):
        block = summed[offset:offset + local.numel()].view(local.shape)
        offset += local.numel()
        param.grad = DTensor.from_local(block, mesh, placements, run_check=False, shape=param.grad.shape,
                                        stride=param.grad.stride())

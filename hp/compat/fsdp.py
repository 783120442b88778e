"""FSDP2 over some axes of a laid-out mesh, on a torch whose `fully_shard` has no `dp_mesh_dims`.

hp lays every parameter out on the whole mesh (replicated over dp and cp,
split over tp or ep) and lets FSDP2 shard it again over the data axes.
torch 2.12 and later do that directly (`fully_shard(dp_mesh_dims=...)`).
torch 2.11 knows only torchtitan's arrangement: FSDP gets a mesh of the data
axes and the parameters are DTensors on the mesh of the other axes (or
plain tensors when there are none), so its gathered parameters live on that
smaller mesh, where they cannot meet activations laid out on the whole one.

This module builds the first from the second, one unit at a time:

1. each parameter the unit will manage is moved, values untouched, from the
   whole mesh to the mesh of the other axes (its local block, as a plain
   tensor when no axis is left);
2. `fully_shard` runs on the flattened data axes, as torchtitan calls it;
3. each of the unit's FSDP parameters then presents its gathered value on
   the whole mesh again (replicated over the data axes, laid out as before
   over the others), and hands FSDP's reduce-scatter its gradient as the
   local part of a sum over the data axes, which the reduce-scatter (a
   sum, see `hp.parallel.data_parallel`) adds up. So the forward and the gradients
   are those of `dp_mesh_dims`; what differs is where the sharded
   parameters (and so their optimizer states and checkpoints) live: a mesh
   of the data axes (flattened, named by them joined with `_`) and the
   other axes, not the whole mesh.

Step 3 sets two attributes and one method of FSDP2's per-parameter record
(`FSDPParam`), those it reads for the gathered value and its gradient. The
layout's attribute is `_tp_spec` on 2.11 and `_unsharded_dtensor_spec` from
2.12 on, so the same steps run on every release: hp uses them where
`dp_mesh_dims` is missing, and its tests run them on 2.13 as well, against
`dp_mesh_dims` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from hp.layouts.reshard import reshard


def fully_shard_on_axes(module: nn.Module, mesh, axes: Sequence[str], *, ignored_params: set = frozenset(),
                        **options):
    """`fully_shard(module, dp_mesh_dims=axes)` on the whole `mesh`, built from `fully_shard` without it.

    `options` are `fully_shard`'s others (`reshard_after_forward`, `mp_policy`,
    `shard_placement_fn`). Parameters of units inside `module`, and `ignored_params`, are left
    alone. Returns the FSDP module, as `fully_shard` does.
    """
    from torch.distributed.fsdp import fully_shard

    axes = tuple(axes)
    spec_of = _move_to_other_axes(module, mesh, axes, ignored_params)
    unit = fully_shard(module, mesh=_data_mesh(mesh, axes), ignored_params=set(ignored_params) or None, **options)
    dims = frozenset(mesh.mesh_dim_names.index(a) for a in axes)
    group, record = unit._get_fsdp_state()._fsdp_param_group, _layout_record()
    for param in group.fsdp_params if group is not None else ():
        info = param._module_info
        spec = spec_of[id(info.module), info.param_name]
        setattr(param, record, spec)
        param.is_dtensor = True
        param._get_grad_inner_tensor = partial(_local_part, spec, dims)
    return unit


def _layout_record() -> str:
    """The name of `FSDPParam`'s record of the layout it gives a gathered parameter."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return "_tp_spec" if "_tp_spec" in FSDPParam.__annotations__ else "_unsharded_dtensor_spec"


def _move_to_other_axes(module: nn.Module, mesh, axes: tuple[str, ...], ignored) -> dict:
    """Move the parameters the unit will manage off the data `axes`; {(id(module), name): whole-mesh spec}."""
    from torch.distributed.fsdp import FSDPModule

    kept = tuple(n for n in mesh.mesh_dim_names if n not in axes)
    other = mesh[kept] if kept else None
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    moved, spec_of = {}, {}
    for path, owner in module.named_modules():
        for name, param in list(owner._parameters.items()):
            if not isinstance(param, DTensor) or id(param) in inner or param in ignored:
                continue  # not laid out, sharded by an inner unit already, or left out of FSDP
            if id(param) not in moved:
                moved[id(param)] = _on_other_axes(param, mesh, axes, kept, other, f"{path}.{name}".lstrip("."))
            owner._parameters[name] = moved[id(param)]
            spec_of[id(owner), name] = DTensorSpec(mesh, param.placements, tensor_meta=param._spec.tensor_meta)
    return spec_of


def _on_other_axes(param: DTensor, mesh, axes: tuple[str, ...], kept: tuple[str, ...], other,
                   where: str) -> nn.Parameter:
    """`param` (called `where`)'s local block as a parameter on the mesh of `kept` axes (plain with none)."""
    names = mesh.mesh_dim_names
    split = [a for a in axes if not param.placements[names.index(a)].is_replicate()]
    if split:
        raise ValueError(f"FSDP shards parameters over {axes}, but {where} is laid out over {split} "
                         f"({param.placements} on {names}): lay it out replicated there")
    local = param.to_local().detach()
    if other is not None:
        placements = [param.placements[names.index(a)] for a in kept]
        local = DTensor.from_local(local, other, placements, run_check=False, shape=param.shape,
                                   stride=param.stride())
    return nn.Parameter(local, requires_grad=param.requires_grad)


def _data_mesh(mesh, axes: tuple[str, ...]):
    """The 1-D mesh FSDP shards over: `axes` of `mesh`, flattened when there are several."""
    if len(axes) == 1:
        return mesh[axes[0]]
    return mesh[axes]._flatten("_".join(axes))


def _local_part(spec: DTensorSpec, dims: frozenset[int], grad: torch.Tensor) -> torch.Tensor:
    """A gathered parameter's gradient as this rank's part of the sum over the data mesh `dims`, laid
    out as the parameter is over the others: the block FSDP's summing reduce-scatter takes."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(grad, AsyncCollectiveTensor):
        grad = grad.wait()
    # hp's move, not DTensor's: it keeps fused dims whole on 2.11 and turns a replicated gradient pending
    grad = reshard(grad, tuple(Partial() if m in dims else p for m, p in enumerate(spec.placements)))
    return grad._local_tensor


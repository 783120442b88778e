"""DTensors built around local blocks at a small host cost.

Building a `DTensorSpec` costs more than a small op, and `DTensor.__init__`
crosses a dynamo-disabled frame on each call: on the hot paths of a step
(every kernel's result, every resolved pending sum) those two dominate. A
spec is built once per signature and kept on its mesh; a DTensor is made
with `__new__` alone. Both serve eager code only: under tracing, build
DTensors as DTensor itself does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

_SPECS_PER_MESH = 4096


def spec_for(mesh, placements: tuple, shape: tuple, stride: tuple, dtype: torch.dtype) -> DTensorSpec:
    """A DTensor spec, built once per signature.

    Kept on the mesh object itself: meshes compare by shape and names, and an equal mesh of
    another (since destroyed) world must not lend its process groups.

    >>> import hp, torch
    >>> from torch.distributed.tensor import Replicate
    >>> mesh = hp.mesh(tp=1, simulate=True)
    >>> spec_for(mesh, (Replicate(),), (2,), (1,), torch.float32) is spec_for(mesh, (Replicate(),), (2,), (1,), torch.float32)
    True
    """
    cache = mesh.__dict__.setdefault("_hp_specs", {})
    key = (placements, shape, stride, dtype)
    try:
        spec = cache.get(key)
    except TypeError:  # symbolic sizes (simulated ranks with unequal blocks) do not hash
        return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    if spec is None:
        if len(cache) >= _SPECS_PER_MESH:
            cache.clear()
        spec = cache[key] = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    return spec


def new_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
    """`DTensor(local, spec, requires_grad=...)`, less its `__init__` (which does nothing outside
    `torch.export`). For eager code only.

    >>> import hp, torch
    >>> from torch.distributed.tensor import Replicate
    >>> mesh = hp.mesh(tp=1, simulate=True)
    >>> spec = spec_for(mesh, (Replicate(),), (2,), (1,), torch.float32)
    >>> new_dtensor(torch.ones(2), spec, requires_grad=False).placements
    (Replicate(),)
    """
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)

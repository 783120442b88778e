"""`hp.mesh`: a named DeviceMesh over this run's processes, real or simulated.

It detects the device and backend (`hp.device`), joins torchrun's process
group when launched by it, runs as a one-rank world when launched plainly,
and with `simulate=True` builds a `fake` process group in one process, for
planning and counting collectives at scale (use it with `hp.simulated` to
compute real values). A simulated world grows to the largest mesh asked for
and stays: a smaller mesh takes its first ranks, as JAX's meshes take the
first of the host's devices, so that DTensor's cached sharding decisions
survive from one mesh to the next.
"""

from __future__ import annotations

import atexit
import math
import os
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp.device import bind_local_device, detect

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# process-group name -> mesh axis name, so that collectives can be reported per axis
_AXIS_OF_GROUP: dict[str, str] = {}


class MeshError(ValueError):
    """A mesh that cannot be built: bad axis names or sizes, or the wrong world size."""


def mesh(
    spec: str | Sequence[tuple[str, int]] | None = None,
    /,
    *,
    simulate: bool = False,
    **axes: int,
) -> DeviceMesh:
    """A DeviceMesh whose dimensions are named, major axis first.

    Axes come as keywords (`hp.mesh(dp=2, tp=4)`), as a string
    (`hp.mesh("dp=2 tp=4")`, handy in configs) or as (name, size) pairs.
    A size-1 axis is allowed, so one plan runs at any degree.

    >>> import hp
    >>> m = hp.mesh(dp=2, tp=4, simulate=True)
    >>> m.mesh_dim_names, tuple(m.shape)
    (('dp', 'tp'), (2, 4))
    """
    named = _axes(spec, axes)
    size = math.prod(n for _, n in named)
    names = tuple(a for a, _ in named)
    shape = tuple(n for _, n in named)
    if simulate:
        _init_fake_world(size)  # the first `size` ranks of a world at least that large
        return _remember_axes(DeviceMesh("cpu", torch.arange(size).view(shape), mesh_dim_names=names))
    device = detect()
    _init_real_world(device, size)
    world = dist.get_world_size()
    if world != size:
        raise MeshError(
            f"hp.mesh({_show(named)}) needs {size} processes but this run has {world}; "
            f"launch with `torchrun --nproc-per-node {size} ...`, or pass simulate=True"
        )
    return _remember_axes(init_device_mesh(device.type, shape, mesh_dim_names=names))


def _remember_axes(m: DeviceMesh) -> DeviceMesh:
    for i, name in enumerate(m.mesh_dim_names):
        _AXIS_OF_GROUP[m.get_group(i).group_name] = name
    return m


def name_group(group, axis: str) -> None:
    """Count `group`'s collectives under mesh axis `axis` (a group of its own over that axis's ranks)."""
    _AXIS_OF_GROUP[group.group_name] = axis


def axis_of_group(group_name: str) -> str | None:
    """The mesh axis (of the latest hp.mesh) whose process group is `group_name`."""
    return _AXIS_OF_GROUP.get(group_name)


def _axes(spec, kwargs: dict[str, int]) -> list[tuple[str, int]]:
    pairs: list[tuple[str, object]] = []
    if isinstance(spec, str):
        for token in spec.split():
            name, eq, value = token.partition("=")
            if not eq:
                raise MeshError(f"mesh axis {token!r} must be written name=size, as in 'tp=4'")
            pairs.append((name, int(value) if value.lstrip("-").isdigit() else value))
    elif spec is not None:
        pairs.extend(tuple(p) for p in spec)
    pairs.extend(kwargs.items())
    if not pairs:
        raise MeshError("a mesh needs at least one axis, as in hp.mesh(tp=2)")
    seen: set[str] = set()
    for name, value in pairs:
        if not isinstance(name, str) or not _IDENT.match(name):
            raise MeshError(f"mesh axis name {name!r} is not an identifier")
        if name in seen:
            raise MeshError(f"mesh axis '{name}' is given twice")
        seen.add(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MeshError(f"mesh axis '{name}' has size {value!r}; sizes are positive integers")
    return [(name, value) for name, value in pairs]  # type: ignore[misc]


def _show(named: list[tuple[str, int]]) -> str:
    return ", ".join(f"{a}={n}" for a, n in named)


def _init_fake_world(size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise MeshError(
                "simulate=True needs a process without a real process group; "
                f"this one already runs '{dist.get_backend()}'"
            )
        if dist.get_world_size() >= size:
            # A smaller mesh takes the first ranks of the world already there: a new world would
            # drop every sharding decision DTensor has cached (_forget_old_groups), and planning
            # each op anew costs a simulated step several times its arithmetic.
            return
        dist.destroy_process_group()
        _forget_old_groups()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def _forget_old_groups() -> None:
    """Drop DTensor's cached decisions: a new mesh equal to an old one has new groups."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _AXIS_OF_GROUP.clear()


def _init_real_world(device, size: int) -> None:
    if dist.is_initialized():
        if dist.get_backend() == "fake":
            raise MeshError(
                "this process already simulates a world (hp.mesh(simulate=True)); "
                "a real mesh needs a process of its own"
            )
        return
    bind_local_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(device.pg_backend)
    else:
        # Launched plainly: a one-rank world, so single-process code runs unchanged.
        dist.init_process_group(device.pg_backend, store=dist.HashStore(), rank=0, world_size=1)
    # A group left alive at interpreter exit can abort a gloo worker ("terminate called
    # without an active exception"): hp tears down what it set up.
    atexit.register(_destroy_world)


def _destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""The annotate API: put tensors on a mesh by layout, change layouts, read them back.

These are the few calls a user writes by hand, in the spirit of JAX's
`device_put` / `with_sharding_constraint`: `shard` (a global tensor to a
DTensor), `constrain` (reshard inside a differentiable program), `from_local`
(assemble a DTensor from per-rank pieces), `layout_of` and `describe` (read a
DTensor's layout back, with the dimension names it was given).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard

from hp.layouts.errors import LayoutError
from hp.layouts.parse import layout as parse
from hp.layouts.placements import bind, from_placements, mesh_axes, to_placements
from hp.layouts.reshard import cut, reshard
from hp.layouts.rules import Rules, resolve
from hp.layouts.types import Layout

LayoutLike = str | Layout
RulesLike = Rules | Mapping[str, str | tuple[str, ...] | None] | None

# DTensors carry no dimension names; hp remembers the layout it gave them here.
_NAMES_ATTR = "_hp_layout"


def _prepare(
    spec: LayoutLike, mesh: DeviceMesh, shape: Sequence[int], rules: RulesLike, uneven: bool
) -> tuple[Layout, tuple[Placement, ...]]:
    """`spec` bound to `mesh` and `shape` under the rules in force, and its placements."""
    layout = resolve(parse(spec), rules)
    try:
        return _bound(layout, mesh, tuple(shape), uneven)
    except TypeError:  # symbolic sizes (simulated ranks with unequal blocks) do not hash
        return _bind_on_device(layout, mesh, shape, uneven)


def placements_for(spec: LayoutLike, mesh: DeviceMesh, shape: Sequence[int], rules: RulesLike = None) -> tuple[Placement, ...]:
    """The placements `constrain` gives a tensor of `shape` under `spec` (checked as it checks them).

    >>> import hp
    >>> placements_for("b s/tp h", hp.mesh(tp=2, simulate=True), (2, 8, 4))
    (Shard(dim=1),)
    """
    return _prepare(spec, mesh, shape, rules, False)[1]


@functools.lru_cache(maxsize=4096)
def _bound(layout: Layout, mesh: DeviceMesh, shape: tuple[int, ...], uneven: bool):
    # Hooks constrain the same layouts every step: checking them once per shape is enough.
    return _bind_on_device(layout, mesh, shape, uneven)


@torch.compiler.assume_constant_result
def _placements_when_traced(spec, mesh, ndim: int, rules, uneven: bool) -> tuple[Placement, ...]:
    """`_prepare`'s placements for a tensor of `ndim` dims, computed once when `torch.compile`
    traces a call and kept as a constant of the graph: parsing and binding are Python that
    dynamo need not trace.

    Placements do not depend on sizes, and sizes may be symbolic in a graph (a sequence length
    that varies between calls): each dim stands in as a multiple of every split, so the size
    checks, which the eager path makes, are skipped here.
    """
    return _prepare(spec, mesh, (math.prod(mesh.shape),) * ndim, rules, uneven)[1]


def _bind_on_device(layout: Layout, mesh: DeviceMesh, shape: Sequence[int], uneven: bool):
    bound = bind(layout, mesh, shape, uneven=uneven)
    if bound.tier != "device":
        raise bound.error(
            f"memory tier '@{bound.tier}' cannot be placed by hand: hp.shard/constrain/from_local place "
            "tensors on the device, and hp.offload chooses tiers from a step's use-definition chains",
            at=("tier",),
        )
    return bound, to_placements(bound, mesh)


def _tag(x: DTensor, bound: Layout) -> DTensor:
    setattr(x, _NAMES_ATTR, bound)
    return x


def keep_names(src: DTensor, dst: DTensor) -> DTensor:
    """`dst` (e.g. an nn.Parameter wrapping `src`) keeps the dim names hp gave `src`."""
    names = getattr(src, _NAMES_ATTR, None)
    return _tag(dst, names) if names is not None else dst


def shard(
    t: torch.Tensor,
    spec: LayoutLike,
    mesh: DeviceMesh,
    *,
    rules: RulesLike = None,
    uneven: bool = False,
    src: int | None = None,
) -> DTensor:
    """Lay the global tensor `t` out on `mesh` as `spec` says.

    Every rank is expected to pass the same `t` (as in JAX's multi-process
    `device_put`) and keeps its own block of it without communication; pass
    `src=0` to scatter rank 0's copy instead. A partial layout (`+tp`) keeps
    `t` on the first rank of each `tp` group and zeros on the others, so the
    pending sum is `t`.

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, tp=2, simulate=True)  # plan in one process
    >>> x = hp.shard(torch.ones(4, 6), "b/dp h/tp", mesh)
    >>> hp.describe(x), tuple(x.to_local().shape)
    ('f32[b=4/dp, h=6/tp]', (2, 3))
    """
    bound, placements = _prepare(spec, mesh, t.shape, rules, uneven)
    placed = [Replicate() if isinstance(p, Partial) else p for p in placements]
    x = _own_copy_per_simulated_rank(distribute_tensor(t, mesh, placed, src_data_rank=src))
    return _tag(reshard(x, placements), bound)


def _own_copy_per_simulated_rank(x: DTensor) -> DTensor:
    """Under LocalTensorMode, give every simulated rank its own storage.

    An untouched replicated block is one plain tensor shared by all simulated ranks;
    an in-place update (an optimizer step) would then be applied once per rank to it.
    """
    mode = enabled_local_tensor_mode()
    local = x._local_tensor
    if mode is None or isinstance(local, LocalTensor):
        return x
    with mode.disable():
        copies = LocalTensor({r: local.detach().clone() for r in mode.ranks})
    owned = DTensor.from_local(
        copies, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )
    return owned.detach().requires_grad_(x.requires_grad)


def constrain(
    x: torch.Tensor,
    spec: LayoutLike,
    *,
    mesh: DeviceMesh | None = None,
    rules: RulesLike = None,
    uneven: bool = False,
    pending_grad: bool = False,
) -> DTensor:
    """Reshard `x` to `spec`, differentiably (like `with_sharding_constraint`).

    A plain tensor is taken as replicated on `mesh` (required then). With `pending_grad`, `x` must be
    replicated wherever `spec` splits it: each rank keeps its block and the gradient comes back as a
    pending sum over the splitting axes, instead of gathered (`hp.layouts.reshard.cut`).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> y = hp.constrain(hp.shard(torch.ones(4, 6), "b h/tp", mesh), "b/tp h")
    >>> str(hp.layout_of(y))
    'b/tp h'
    """
    if not isinstance(x, DTensor):
        if mesh is None:
            raise LayoutError(
                f"hp.constrain got a plain {type(x).__name__} of shape {tuple(x.shape)}; "
                "pass mesh= to treat it as replicated, or hp.shard it first"
            )
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    elif mesh is not None and mesh != x.device_mesh:
        raise LayoutError("hp.constrain cannot move a DTensor to another mesh")
    if torch.compiler.is_compiling():  # traced code keeps no names: placements are all it needs
        bound, placements = None, _placements_when_traced(spec, x.device_mesh, x.ndim, rules, uneven)
    else:
        bound, placements = _prepare(spec, x.device_mesh, x.shape, rules, uneven)
    if tuple(x.placements) == placements:  # (`==`: torch 2.11's dynamo cannot trace `!=` on placements)
        x = x.view_as(x)  # a fresh node, so tagging never renames the caller's tensor
    else:
        x = cut(x, placements) if pending_grad else reshard(x, placements)
    return x if bound is None else _tag(x, bound)


def from_local(
    t_local: torch.Tensor,
    spec: LayoutLike,
    mesh: DeviceMesh,
    *,
    shape: Sequence[int] | None = None,
    rules: RulesLike = None,
) -> DTensor:
    """Assemble a DTensor from each rank's block `t_local`, laid out as `spec`.

    The global shape is each local size times its shard count, unless given
    as `shape` (needed for uneven shards).

    >>> import hp, torch
    >>> mesh = hp.mesh(dp=2, tp=2, simulate=True)
    >>> hp.describe(hp.from_local(torch.zeros(2, 3), "b h/tp +dp", mesh))
    'f32[b=2, h=6/tp] +dp'
    """
    layout = resolve(parse(spec), rules)
    local = layout.expand(tuple(t_local.shape))
    sizes = mesh_axes(mesh)
    counts = [math.prod(sizes.get(a, 1) for a in d.axes) for d in local.dims]
    implied = tuple(n * c for n, c in zip(t_local.shape, counts))
    shape = implied if shape is None else tuple(shape)
    if len(shape) != t_local.dim():
        raise local.error(
            f"shape {shape} has {len(shape)} dims but the local tensor has {t_local.dim()}"
        )
    for i, (got, full, c) in enumerate(zip(t_local.shape, shape, counts)):
        # Simulated ranks with unequal blocks give a symbolic size: nothing to check.
        if isinstance(got, int) and got not in _chunk_sizes(full, c):
            raise local.error(
                f"dimension {i}: a local block of {got} cannot be one of {c} shards "
                f"of a global size {full}",
                at=("dim", i),
            )
    bound, placements = _prepare(layout, mesh, shape, None, uneven=shape != implied)
    stride = torch.empty(tuple(shape), device="meta").stride()
    x = DTensor.from_local(
        t_local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
    return _tag(x, bound)


def _chunk_sizes(full: int, count: int) -> set[int]:
    """Block sizes torch.chunk gives (DTensor's uneven rule), 0 for ranks left empty."""
    step = -(-full // count) if count else full
    sizes = {min(step, full - start) for start in range(0, full, step)} if full else set()
    return sizes | ({0} if full == 0 or -(-full // step) < count else set())


def layout_of(x: DTensor) -> Layout:
    """The layout of a DTensor, with the dim names hp gave it (else sizes).

    >>> import hp, torch
    >>> x = hp.shard(torch.ones(4, 6), "b h/tp", hp.mesh(tp=2, simulate=True))
    >>> hp.layout_of(x)
    Layout('b h/tp')
    """
    if not isinstance(x, DTensor):
        raise LayoutError(f"hp.layout_of needs a DTensor, got {type(x).__name__}")
    names = getattr(x, _NAMES_ATTR, None)
    return from_placements(x.placements, x.device_mesh, x.shape, names=names)


_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64",
}


def describe(x: torch.Tensor) -> str:
    """A JAX-style one-line summary: dtype, named sizes, mesh axes, partial sums.

    A diagnostic, so it never raises: placements no layout reproduces (DTensor
    flattening a dim split over two axes into a strided shard) print as DTensor
    applies them, in mesh order, e.g. `64/dp/tp(strided 2)`.

    >>> import hp, torch
    >>> hp.describe(torch.zeros(2, 3, dtype=torch.bfloat16))
    'bf16[2, 3]'
    >>> from torch.distributed.tensor.placement_types import _StridedShard
    >>> mesh = hp.mesh(dp=2, tp=2, simulate=True)
    >>> x = DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0), _StridedShard(0, split_factor=2)],
    ...                        run_check=False, shape=(8, 4), stride=(4, 1))
    >>> hp.describe(x)
    'f32[8/dp/tp(strided 2), 4]'
    """
    dtype = _DTYPES.get(x.dtype, str(x.dtype).removeprefix("torch."))
    if not isinstance(x, DTensor):
        return f"{dtype}[{', '.join(str(s) for s in x.shape)}]"
    try:
        layout = layout_of(x)
    except LayoutError:
        return f"{dtype}{_as_placed(x)}"
    dims = []
    for dim, size in zip(layout.dims, x.shape):
        label = str(size) if dim.size is not None else f"{dim.name}={size}"
        dims.append(label + "".join(f"/{a}" for a in dim.axes))
    marks = "".join(f" +{a}" for a in layout.partial)
    return f"{dtype}[{', '.join(dims)}]{marks}"


def _as_placed(x: DTensor) -> str:
    """`[sizes with their axes] +partials`, straight from the placements in mesh order."""
    mesh = x.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh{m}" for m in range(mesh.ndim))
    dims = [str(size) for size in x.shape]
    marks = ""
    for axis, p in zip(names, x.placements):
        if isinstance(p, _StridedShard):
            dims[p.dim] += f"/{axis}(strided {p.split_factor})"
        elif isinstance(p, Shard):
            dims[p.dim] += f"/{axis}"
        elif isinstance(p, Partial):
            marks += f" +{axis}" + ("" if p.reduce_op == "sum" else f"({p.reduce_op})")
    return f"[{', '.join(dims)}]{marks}"

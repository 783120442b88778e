"""What older torch releases lack that hp's layouts need, backported when hp is imported.

hp declares torch 2.11 through 2.14. Each backport below checks for the
later release's own fix and does nothing where it is present, so on the
releases CI tests this module changes nothing.

- **A strided shard alone on its dim** (`_StridedShard(d, sf)` with no plain
  shard of d before it: a fused q/k/v weight split over tp, or the rows of
  `(b s/cp)` after flattening). torch 2.11 reads every strided shard as an
  encoded shard order and raises when it is not one, so such a tensor could
  not be gathered or resharded. Later releases fall back to the greedy plan,
  which moves a strided shard through Replicate; so does the backport, which
  also sends a strided shard bound for another split (or a partial sum bound
  for a strided shard) through Replicate: 2.11 has no direct step between them.
- **`t()` of a strided shard**: torch 2.11's rule for `aten.t` moves a
  plain shard to the other dim but leaves a strided shard where it was, so
  the weight gradient of a linear whose tokens are `(b s/cp)` came out
  misshapen (a MoE layer under ep x cp). The backport registers the rule of
  later releases, which moves both.
- **Views inside a decomposition that flatten dims, a later one split**
  (`F.linear` on `b s/cp h` views it as `(b s) h`; SDPA's math path views
  `b n/tp s d` as `(b n) s d`; the backward of a fused q/k/v's view as
  (3, heads/tp, d) flattens it back). torch 2.11 refuses them ("Attempted
  to flatten multiple dimensions"); the backport gives the view the layout
  later releases give it, a strided shard of the flattened dim
  (`hp.ops.flatten.flattened_placements`, which hp's own view kernel uses
  on every release), and each rank views its block. Viewing such a dim
  back as two (`(b s)` to `b s/cp`) takes the inverse
  (`hp.ops.flatten.unflattened_placements`), where 2.11 cut the blocks as
  if the split were plain; and a fused dim (`[q k v]/tp`, a strided shard
  of k parts) viewed as (k, heads, ...) leaves each rank its heads of every
  part, a plain split, where 2.11 refused the view.
- **The backward of top-k, sort, max and min along a dim** on a DTensor:
  `hp.ops.selection.BACKWARD_MIXES_TENSORS`; the kernels are in that module.

FSDP over some axes of a laid-out mesh (`fully_shard(dp_mesh_dims=...)`,
torch 2.13) is built from 2.11's own FSDP2 in `hp.compat.fsdp`, used where
`fsdp_on_the_whole_mesh()` below is false. Not backported: 2.11's DTensor slices a
strided-shard dim as if its blocks were contiguous; hp's fused-dim kernels
(`hp.ops.fused`) gather the dim first for the cuts they see, and hp's own
redistribution (`hp.layouts.reshard`) moves fused dims through Replicate on
every release.

What hp's traced code avoids, so that compiled blocks and losses trace on
2.11's dynamo as on later releases: `type(p) is Shard` on a placement (read
as false there; hp tests placements with `isinstance`), `!=` between
placements (compared with `==`), `slice.indices`, a functional all-gather
along a dim other than 0 (hp gathers along dim 0 and moves the dim back), and
a copy into an empty buffer inside an autograd function (2.11's AOTAutograd
saved the empty buffer for backward).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import _dtensor_spec, _redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
from torch.distributed.tensor._ops import _matrix_ops, _view_ops
from torch.distributed.tensor.placement_types import _StridedShard


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch.

    >>> torch_version() >= (2, 11)
    True
    """
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def install() -> None:
    """Apply every backport this torch needs (idempotent).

    >>> install(); install()
    """
    if not hasattr(_dtensor_spec, "_StridedShardNotDecodableError") and not _redistribute_patched():
        planned = _redistribute._gen_transform_infos_non_cached
        _redistribute._gen_transform_infos_non_cached = _greedy_when_undecodable(planned)
    if transpose_leaves_strided_shards():
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.register_op_strategy(torch.ops.aten.t.default, _transpose_strategy)
    if not _views_flatten_split_dims():
        _view_ops.propagate_shape_and_sharding = _flattening_split_leading_dims(_view_ops.propagate_shape_and_sharding)


def _redistribute_patched() -> bool:
    return hasattr(_redistribute._gen_transform_infos_non_cached, "__hp_backport__")


def _greedy_when_undecodable(planned):
    def transform_infos(src_spec, dst_spec, use_graph_based_transform=None):
        try:
            return planned(src_spec, dst_spec, use_graph_based_transform)
        except ValueError as e:
            if "shard_order" not in str(e):
                raise
        planner = _redistribute.get_redistribute_planner(src_spec.device_mesh, src_spec.tensor_meta)
        return _through_replicate(planner.generate_greedy_transform_infos(src_spec, dst_spec))

    transform_infos.__hp_backport__ = True
    return transform_infos


def transpose_leaves_strided_shards() -> bool:
    """Whether DTensor's own rule for `aten.t` leaves a strided shard on its dim (2.11's does; 2.13's
    moves it, and 2.14 states the op by a single-dim rule that does)."""
    own = getattr(_matrix_ops, "transpose_strategy", None)
    return own is not None and "_StridedShard" not in own.__code__.co_names


def _transpose_strategy(op_schema: OpSchema) -> OpStrategy:
    """`aten.t`'s rule: a 2-D tensor's split (plain or strided) moves to the other dim."""
    out = []
    for strategy in op_schema.args_schema[0].strategies:
        spec = strategy.output_spec
        placements = tuple(_other_dim(p) if spec.ndim == 2 else p for p in spec.placements)
        out.append(OpSpec(output_specs=DTensorSpec(spec.mesh, placements), input_specs=(spec,)))
    return OpStrategy(out)


def _other_dim(p):
    from hp.ops.flatten import moved  # late: install() runs before hp.ops is first imported

    return moved(p, 1 - p.dim) if isinstance(p, (Shard, _StridedShard)) else p


def _views_flatten_split_dims() -> bool:
    """Whether DTensor views `b s/cp` as `(b s)`, or hp's backport does."""
    shape, rule = (2, 4), _view_ops.view_groups((2, 4), (8,))
    try:
        _view_ops.propagate_shape_and_sharding((Shard(1),), shape, rule, (2,), True)
    except RuntimeError:
        return False
    return True


def _flattening_split_leading_dims(propagate):
    def propagate_shape_and_sharding(placements, shape, rule, mesh_shape, strict_view=False):
        from hp.ops import flatten  # late: install() runs before hp.ops is first imported

        rows = _leading_split(rule, len(shape))
        unflattened = None if rows is None else flatten.unflattened_placements(shape, placements, mesh_shape, rows)
        if unflattened is not None:
            return tuple(placements), tuple(unflattened[0])
        parts = _parts_split(placements, rule, mesh_shape)
        if parts is not None:
            return tuple(placements), tuple(parts)
        try:
            return propagate(placements, shape, rule, mesh_shape, strict_view)
        except RuntimeError as e:
            group = _flattened_group(rule, len(shape))
            out = None if group is None else flatten.flattened_placements(shape, placements, mesh_shape, *group)
            if out is None or "Attempted to flatten" not in str(e):
                raise
            return tuple(placements), tuple(out)

    return propagate_shape_and_sharding


def _flattened_group(rule, ndim: int) -> tuple[int, int] | None:
    """(g, a) when the view `rule` makes input dims a..a+g-1 one dim and keeps the others in order, else None."""
    flat = [j for j, r in enumerate(rule) if not isinstance(r, _view_ops.InputDim)]
    if len(flat) != 1 or not isinstance(rule[flat[0]], _view_ops.Flatten):
        return None
    start, group = flat[0], len(rule[flat[0]].input_dims)
    wanted = [_view_ops.InputDim(d) for d in range(ndim)]
    wanted[start:start + group] = [_view_ops.Flatten(tuple(wanted[start:start + group]))]
    return (group, start) if list(rule) == wanted else None


def _leading_split(rule, ndim: int) -> int | None:
    """The rows when the view `rule` makes input dim 0 its dims 0 and 1 (rows, rest) and keeps the rest."""
    if len(rule) != ndim + 1 or not all(isinstance(r, _view_ops.Split) for r in rule[:2]):
        return None
    first, second = rule[:2]
    whole = (_view_ops.InputDim(0), first.group_shape)
    if (first.input_dim, first.group_shape, first.split_id) != (*whole, 0) or \
            (second.input_dim, second.group_shape, second.split_id) != (*whole, 1) or len(first.group_shape) != 2:
        return None
    if tuple(rule[2:]) != tuple(_view_ops.InputDim(d) for d in range(1, ndim)):
        return None
    return first.group_shape[0]


def _parts_split(placements, rule, mesh_shape) -> list | None:
    """The placements after a view splitting a fused dim (`_StridedShard(d, k)`) into (k, rest...): its
    split moves, plain, to the dim after the k parts; other splits follow their dims. None for other views."""
    from hp.ops.flatten import moved  # late: install() runs before hp.ops is first imported

    whole_at, parts_at = {}, {}  # input dim -> the output dim that keeps it whole / that follows its parts
    for j, r in enumerate(rule):
        if isinstance(r, _view_ops.InputDim):
            whole_at[r.input_dim] = j
        elif isinstance(r, _view_ops.Split) and isinstance(r.input_dim, _view_ops.InputDim) and r.split_id == 1:
            parts_at[r.input_dim.input_dim] = (r.group_shape, j)
    out, moved_parts = [], set()
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard) and p.dim in parts_at:
            group, j = parts_at[p.dim]
            if group[0] != p.split_factor or group[1] % mesh_shape[m] or p.dim in moved_parts:
                return None
            moved_parts.add(p.dim)
            out.append(Shard(j))
        elif isinstance(p, (Shard, _StridedShard)):
            if p.dim not in whole_at:
                return None
            out.append(moved(p, whole_at[p.dim]))
        else:
            out.append(p)
    return out if moved_parts else None


def _through_replicate(infos: list) -> list:
    """Each step between a strided shard and another split (or a partial sum) taken through Replicate."""
    out = []
    for info in infos:
        src, dst = info.src_dst_placements
        if any(isinstance(p, _StridedShard) for p in (src, dst)) and not (src.is_replicate() or dst.is_replicate()):
            out.append(type(info)(info.mesh_dim, (src, Replicate()), info.logical_shape))
            out.append(type(info)(info.mesh_dim, (Replicate(), dst), info.logical_shape))
        else:
            out.append(info)
    return out


def fsdp_on_the_whole_mesh() -> bool:
    """Whether FSDP2 can shard over some axes of a mesh whose other axes lay parameters out
    (`fully_shard(dp_mesh_dims=...)`, torch 2.13); without it hp shards through `hp.compat.fsdp`.
    Asked when FSDP is applied: importing FSDP costs a second that runs without it need not pay."""
    from torch.distributed import fsdp

    return hasattr(fsdp, "DataParallelMeshDims")

"""Gather and scatter along one dim of rows split on another: each rank's rows alone, whatever the split.

A router's scores are `(b s) experts` with the tokens split as the batch
and sequence were: under cp or sp the flattened tokens are
`_StridedShard(0, split_factor=b)` (hp/ops/flatten.py). Picking or adding
along the experts (`gather`, `scatter`, `scatter_add`, as PhiMoE's
`sparsemixer` and its custom backward do) touches each token's row alone, so
each rank can run the op on its block. DTensor's strategies offer only plain
`Shard(d)` for that: a strided split is all-gathered in forward, and in
backward the in-place `scatter_add_` (which has no strategy of its own and
goes through a decomposition) comes back marked replicated while each rank
still holds its block, so the next matmul meets rows of the wrong count.
Here every such op also gets the strategies that lay every operand out as
one of them is (an in-place op's: as its input), when that layout does not
split the op's dim and the operands agree in size on every dim it splits;
one that moves nothing is taken alone. `scatter_add_` gets DTensor's
`scatter_add` strategies too, less those that would move its own tensor (an
in-place op cannot).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Shard, _StridedShard

aten = torch.ops.aten


def row_local_placements(specs: list, dim: int, placements: tuple) -> bool:
    """Whether, with every operand of `specs` (input, index, src) laid out as `placements`, each
    rank's rows stand alone along `dim`.

    Nothing may split `dim` (the indices address all of it) or hold a pending sum, and the
    operands must be of one size on every split dim (a smaller index or src would be cut at
    other rows).

    >>> from types import SimpleNamespace as S
    >>> rows = (_StridedShard(0, split_factor=4),)
    >>> row_local_placements([S(shape=(64, 8)), S(shape=(64, 1))], 1, rows)
    True
    >>> row_local_placements([S(shape=(64, 8)), S(shape=(32, 1))], 1, rows)
    False
    """
    if any(p.is_partial() for p in placements) or len({len(s.shape) for s in specs}) != 1:
        return False
    split = {p.dim for p in placements if isinstance(p, (Shard, _StridedShard))}
    return bool(split) and dim not in split and all(len({s.shape[d] for s in specs}) == 1 for d in split)


def _with_row_local(default, inplace: bool = False):
    """DTensor's strategy `default` for the op, plus one laying every operand out as one of them is
    (as the input alone for an in-place op, of whose strategies only those that leave the input
    where it is are kept).

    One of those that moves nothing (each operand laid out so already, or replicated and only
    cut) is taken alone: DTensor's own are no cheaper, and its pricing can fail (it finds no
    path from two strided splits of one dim to gather's masked partial, nor to themselves)."""

    def strategy(op_schema: OpSchema):
        tensors = op_schema.args_strategy
        specs = [t.strategies[0].output_spec for t in tensors]  # each operand as it is
        dim = op_schema.args_schema[1] % tensors[0].ndim
        targets = [kept for kept in dict.fromkeys(tuple(s.placements) for s in (specs[:1] if inplace else specs))
                   if row_local_placements(specs, dim, kept)]
        free = next((kept for kept in targets if all(_only_cut(s.placements, kept) for s in specs)), None)
        if free is not None:
            return OpStrategy([_row_local(tensors, specs, free, cost=0.0)])
        result = default(op_schema)
        if inplace:
            result = OpStrategy([s for s in result.strategies if s.input_specs[0].placements == specs[0].placements])
        result.strategies.extend(_row_local(tensors, specs, kept) for kept in targets)
        return result

    return strategy


def _only_cut(placements, kept: tuple) -> bool:
    """Whether an operand laid out as `placements` gets to `kept` moving nothing."""
    return tuple(placements) == kept or all(p.is_replicate() for p in placements)


def _row_local(tensors, specs, kept: tuple, cost: float | None = None) -> OpSpec:
    """Every operand laid out as `kept`, the result too: each rank runs the op on its rows.
    `cost`: the redistribution's, when known (else DTensor's estimate)."""
    wanted = [DTensorSpec(s.mesh, kept, tensor_meta=s.tensor_meta) for s in specs]
    costs = [[cost] * len(t.strategies) if cost is not None else generate_redistribute_costs(t, w)
             for t, w in zip(tensors, wanted)]
    return OpSpec(output_specs=DTensorSpec(specs[0].mesh, kept), input_specs=tuple(wanted), redistribute_cost=costs)


def _register(ops: dict) -> None:
    """Give each op DTensor's strategy for its pair (looked up before any is replaced) plus the
    row-local ones; an op whose pair has none on this torch release is left as DTensor has it."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    defaults = {op: propagator.op_strategy_funcs.get(like) for op, like in ops.items()}
    for op, default in defaults.items():
        if default is not None:
            inplace = op._schema.name.endswith("_")  # aten::scatter_: its input keeps its layout
            propagator.register_op_strategy(op, _with_row_local(default, inplace), RuntimeSchemaInfo(1))


_SAME = (aten.gather.default, aten.scatter_add.default, aten.scatter.src, aten.scatter.value, aten.scatter_.src,
         aten.scatter_.value)
_register({**{op: op for op in _SAME}, aten.scatter_add_.default: aten.scatter_add.default})  # it has none of its own

"""New tensors shaped like a split one: `x.new_empty(shape)` keeps x's split where the shapes agree.

DTensor lets a factory's result (`new_empty`, `new_zeros`, `new_ones`,
`new_full`) follow its input only when the two shapes are equal, and
replicates it otherwise. A model that builds a buffer one dim wider than a
split input and copies the split parts in then gathers every part on every
rank: DeepSeek-V2's keys are `new_empty` with the head dim of nope + rope
and a `copy_` of each part, so its heads, split over tp, were gathered three
times a layer. Here each dim of the result keeps the input's split when its
size is the input's (any other mesh axis leaves it replicated): the values
are what the op writes, uninitialised or one constant, so any split of them
is exact, and nothing moves.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, RuntimeSchemaInfo
from torch.distributed.tensor._ops._tensor_ops import new_factory_strategy
from torch.distributed.tensor.placement_types import _StridedShard

aten = torch.ops.aten
FACTORIES = (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)


def kept_split(placements, shape, new_shape) -> tuple:
    """The placements of a factory's result: the input's splits on dims whose size stays, else replicated.

    >>> kept_split((Shard(1), Replicate()), (4, 8, 16, 16), (4, 8, 16, 12))
    (Shard(dim=1), Replicate())
    >>> kept_split((Shard(3),), (4, 8, 16, 16), (4, 8, 16, 12))
    (Replicate(),)
    """
    same = len(shape) == len(new_shape)
    plain = [isinstance(p, Shard) and not isinstance(p, _StridedShard) for p in placements]  # a plain split
    return tuple(p if keep and same and shape[p.dim] == new_shape[p.dim] else Replicate()
                 for p, keep in zip(placements, plain))


def _strategy(op_schema: OpSchema):
    strategy = new_factory_strategy(op_schema)  # DTensor's: replicated, or the input's when shapes are equal
    inputs, new_shape = op_schema.args_schema[0], op_schema.args_schema[1]
    if tuple(inputs.shape) == tuple(new_shape):
        return strategy
    for spec in inputs.strategies:
        source = spec.output_spec
        kept = kept_split(source.placements, tuple(inputs.shape), tuple(new_shape))
        if any(isinstance(p, Shard) for p in kept):
            strategy.strategies.append(OpSpec(
                output_specs=DTensorSpec(source.mesh, kept),
                input_specs=(source,),
                redistribute_cost=[[-0.1] * len(inputs.strategies)],  # preferred, as DTensor's own follow-the-input
            ))
    return strategy


for _op in FACTORIES:
    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(_op, _strategy, RuntimeSchemaInfo(1, ["dtype"]))

"""`hp.rule`: declare how an op's dimensions map, and get DTensor sharding strategies.

A rule names the factors of each tensor argument and result in einsum-like
notation, `"m k, k n -> m n"`, and says which factors are summed
(`sum="k"`: splitting k leaves partial sums in the results) and which must
stay whole (`whole="t"`: splitting them would change the values). From that,
for every factor that may be split, one single-mesh-axis strategy follows:
the arguments that carry the factor are split on it, the others replicated,
the results split on it or partial. DTensor expands these to the whole mesh
and picks the cheapest one for the inputs at hand, redistributing the rest.

Tensor arguments are matched in schema order (optional tensors that are
None at the call are skipped); a tensor passed by keyword (an attention
mask) is not in the spec and makes the op run replicated. A dimension named `_` is never split, and a
factor whose dimension has size 1 in some argument (broadcast) leaves that
argument replicated. The spec may be a function of the call's arguments
(tensors arrive as DTensor specs with `.shape`), for rules that depend on
flags such as `is_causal`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy


# Every op hp.rule registered, for the rule harness: op -> (spec, sum, whole)
REGISTERED: dict = {}


class RuleError(ValueError):
    """A malformed rule, or an op that has none for the layouts it got."""


@dataclass(frozen=True)
class FactorSpec:
    """Parsed `"m k, k n -> m n"`: factor names per argument and per result."""

    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    sum: frozenset[str]
    whole: frozenset[str]

    @property
    def splittable(self) -> list[str]:
        seen: list[str] = []
        for names in self.inputs:
            for f in names:
                if f != "_" and f not in self.whole and f not in seen:
                    seen.append(f)
        return seen


def parse_factors(
    text: str, sum: str = "", whole: str = "", callable_options: bool = False
) -> FactorSpec:
    """Parse and check a factor spec.

    >>> parse_factors("m k, k n -> m n", sum="k").splittable
    ['m', 'k', 'n']
    """
    if "->" not in text:
        raise RuleError(f"rule {text!r} needs '->' between arguments and results")
    lhs, rhs = text.split("->")
    inputs = tuple(tuple(part.split()) for part in lhs.split(","))
    outputs = tuple(tuple(part.split()) for part in rhs.split(","))
    spec = FactorSpec(inputs, outputs, frozenset(sum.split()), frozenset(whole.split()))
    for f in spec.splittable:
        for k, out in enumerate(spec.outputs):
            if f not in out and f not in spec.sum:
                raise RuleError(
                    f"rule {text!r}: factor '{f}' is missing from result {k}; "
                    f"declare it sum='{f}' (split gives partial sums) or whole='{f}'"
                )
    for f in spec.sum | spec.whole:
        if not any(f in names for names in inputs) and not callable_options:
            raise RuleError(f"rule {text!r}: factor '{f}' of sum=/whole= is in no argument")
    return spec


def _single_axis_strategies(spec: FactorSpec, args: tuple, n_outputs: int) -> list[list]:
    """[outputs..., one entry per positional arg] placements for one mesh axis."""
    tensor_slots = [i for i, a in enumerate(args) if isinstance(a, DTensorSpec)]
    if len(tensor_slots) > len(spec.inputs):
        raise RuleError(f"rule has {len(spec.inputs)} arguments but the call passed {len(tensor_slots)} tensors")

    def row(outs, ins):
        slots: list = [None] * len(args)
        for slot, p in zip(tensor_slots, ins):
            slots[slot] = p
        return list(outs) + slots

    strategies = [row([Replicate()] * n_outputs, [Replicate()] * len(tensor_slots))]
    for f in spec.splittable:
        ins = []
        for slot, names in zip(tensor_slots, spec.inputs):
            shape = args[slot].shape
            d = names.index(f) if f in names else None
            ins.append(Shard(d) if d is not None and shape[d] != 1 else Replicate())
        if all(isinstance(p, Replicate) for p in ins):
            continue
        outs = [Shard(out.index(f)) if f in out else Partial() for out in spec.outputs]
        strategies.append(row(outs, ins))
    return strategies


def rule(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload],
    spec: str | Callable[..., str],
    *,
    sum: str = "",
    whole: str | Callable[..., str] = "",
) -> None:
    """Register a sharding rule for `op` (an `OpOverload`, or several with one rule).

    A custom kernel (an NPU fused op, say) gets DTensor support in one line:

    >>> import torch, hp
    >>> @torch.library.custom_op("hpdoc::rms_scale", mutates_args=())
    ... def rms_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ...     return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    >>> @rms_scale.register_fake
    ... def _(x, w):
    ...     return torch.empty_like(x)
    >>> hp.rule(torch.ops.hpdoc.rms_scale.default, "b s h, h -> b s h", whole="h")
    """
    ops = op if isinstance(op, list) else [op]
    static = callable(spec) or callable(whole)
    if not static:
        parse_factors(spec, sum, whole)  # fail at registration, not at the first call

    def strategy(op_schema: OpSchema):
        args, kwargs = op_schema.args_schema, op_schema.kwargs_schema
        specs = tuple(_first_spec(a) for a in args)
        text = spec(*specs, **kwargs) if callable(spec) else spec
        keep = whole(*specs, **kwargs) if callable(whole) else whole
        factors = parse_factors(text, sum, keep, callable_options=static)
        n_out = len(op_schema.op._schema.returns)
        strategies = _single_axis_strategies(factors, specs, n_out)
        tensor_kwargs = [k for k, v in kwargs.items() if isinstance(_first_spec(v), DTensorSpec)]
        if tensor_kwargs:
            # A tensor keyword (an attention mask) has no factors in the rule: it is passed
            # whole, and only the all-replicated strategy is safe with it.
            strategies = [strategies[0] + [Replicate()] * len(tensor_kwargs)]
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(),
            op_schema,
            strategies,
            input_index=n_out,
            inplace_op=op_schema.is_inplace_op(),
        )

    for overload in ops:
        REGISTERED[overload] = (spec, sum, whole)
        DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
            overload, strategy, _schema_info(overload, static)
        )


def _first_spec(arg):
    """DTensor hands strategies in; a rule wants the spec of the input as it is."""
    strategies = getattr(arg, "strategies", None)
    return strategies[0].output_spec if strategies else arg


def _schema_info(op: torch._ops.OpOverload, static: bool) -> RuntimeSchemaInfo:
    """Cache sharding decisions on the non-tensor arguments when the rule reads them."""
    if not static:
        return RuntimeSchemaInfo(needs_pytree=True)
    arguments = op._schema.arguments
    first = next(
        (i for i, a in enumerate(arguments) if not a.kwarg_only and "Tensor" not in str(a.type)),
        100,
    )
    kw = [a.name for a in arguments if a.kwarg_only and "Tensor" not in str(a.type)]
    return RuntimeSchemaInfo(static_argnum=first, static_kwargkey=kw or None, needs_pytree=True)

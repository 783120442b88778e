"""`hp.parallelize`: lay a module's parameters out by a plan of layouts, in place.

A plan maps parameter-name globs to layouts (`{"*.q_proj.weight": "out/tp in"}`,
first match wins); parameters no entry matches stay replicated, and an entry
that matches nothing is an error (a typo would otherwise silently replicate).
Tied parameters (an LM head sharing the embedding) are one tensor with
several names: an entry for any of the names lays it out once, and two
different layouts for its names are a `PlanError` naming both.
Optional `inputs` and `outputs` lay out module arguments and results, and
`experts` names experts modules (called `experts(tokens, expert_ids,
weights)`, their experts packed along dim 0 of each parameter), which then
run expert parallel as their layouts say (`hp.ops.expert_parallel`). The
module's code is untouched: its forward runs inside `hp.region()`, so the
plain tensors it makes are taken as replicated and the op rules do the rest.

Parameters on the meta device become sharded meta DTensors: call
`module.to_empty(device=...)` and initialise or load them, and no rank ever
holds a whole large weight.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from hp.layouts import Layout, LayoutError, constrain, layout, shard
from hp.layouts.annotate import keep_names, placements_for
from hp.layouts.placements import bind, to_placements
from hp.layouts.rules import Rules, resolve
from hp.ops import overlap
from hp.ops.expert_parallel import expert_parallel
from hp.ops.region import region
from hp.parallel.ties import names_by_parameter

Layouts = str | Layout | tuple | Mapping


class PlanError(ValueError):
    """A plan entry that matches nothing, or a layout that does not fit its parameter."""


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, str | Layout],
    *,
    inputs: Mapping[str, Layouts] | None = None,
    outputs: Mapping[str, Layouts] | None = None,
    rules: Rules | Mapping | None = None,
    experts: Sequence[str] = (),
) -> nn.Module:
    """Shard `module`'s parameters by `plan` and run its forward in an hp region.

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> mlp = hp.parallelize(mlp, mesh, {"0.weight": "out/tp in", "0.bias": "out/tp", "2.weight": "out in/tp"})
    >>> hp.describe(mlp[2].weight), hp.describe(mlp[2].bias)
    ('f32[out=8, in=32/tp]', 'f32[8]')
    """
    replaced: dict[int, nn.Parameter] = {}
    for names, param, spec in _planned(module, plan, mesh, rules):
        placed = _place(param.detach(), spec, mesh)
        replaced[id(param)] = keep_names(placed, nn.Parameter(placed, requires_grad=param.requires_grad))
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_name), attr, replaced[id(param)])
    _layout_io(module, mesh, inputs or {}, outputs or {}, rules)
    if experts and not expert_parallel(module, experts):
        raise PlanError(f"hp.parallelize: experts entries {list(experts)} match no module")
    _run_in_region(module)
    return module


def _match_tied(plan, names: list[str], used: set[str]) -> Layout:
    """The layout the plan gives a parameter under any of its names; two different ones are an error."""
    found = {name: _match(plan, name, used) for name in names}
    given = {name: spec for name, spec in found.items() if spec is not None}
    if len({str(spec) for spec in given.values()}) > 1:
        shown = ", ".join(f"'{name}' -> '{spec}'" for name, spec in given.items())
        raise PlanError(f"hp.parallelize: tied parameters get different layouts ({shown}); "
                        "they are one tensor: give one layout (or name only one of them)")
    return next(iter(given.values()), layout("..."))


def _match(plan, name: str, used: set[str]) -> Layout | None:
    for pattern, spec in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            used.add(pattern)
            return layout(spec)
    return None


def check_plan(
    module: nn.Module, axes: DeviceMesh | Mapping[str, int], plan: Mapping[str, str | Layout], *, rules=None
) -> None:
    """What `parallelize` would refuse, found without a mesh or any data (a meta-device model will do).

    `axes` is the mesh, or only its axis sizes (`{"tp": 2}`), so a launcher can check a plan
    before any worker starts.

    >>> import torch
    >>> check_plan(torch.nn.Linear(8, 6), {"tp": 4}, {"weight": "out/tp in"})
    Traceback (most recent call last):
    ...
    hp.parallel.parallelize.PlanError: parameter 'weight' of shape (6, 8): dimension 0 has size 6, not divisible by its 4 shards (tp=4); pass uneven=True to allow torch.chunk-style uneven shards
      out/tp in
      ^^^^^^
    """
    _planned(module, plan, axes, rules)


def _planned(module: nn.Module, plan, axes, rules) -> list[tuple[list[str], nn.Parameter, Layout]]:
    """(names, parameter, bound layout) of each parameter once; PlanError for what does not fit."""
    used: set[str] = set()
    planned = []
    for names in names_by_parameter(module):  # tied weights have several names
        param = module.get_parameter(names[0])
        spec = _match_tied(plan, names, used)
        try:
            planned.append((names, param, bind(resolve(spec, rules), axes, param.shape)))
        except LayoutError as e:
            raise PlanError(f"parameter '{names[0]}' of shape {tuple(param.shape)}: {e}") from None
    unused = [k for k in plan if k not in used]
    if unused:
        raise PlanError(f"hp.parallelize: plan entries {unused} match no parameter of {type(module).__name__}")
    return planned


def _place(t: torch.Tensor, bound: Layout, mesh: DeviceMesh) -> DTensor:
    if t.device.type != "meta":
        return shard(t, bound, mesh)
    return distribute_tensor(t, mesh, to_placements(bound, mesh))


def _layout_io(module: nn.Module, mesh, inputs, outputs, rules) -> None:
    for pattern, specs in inputs.items():
        for target in _modules(module, pattern, "inputs"):
            target.register_forward_pre_hook(_input_hook(specs, mesh, rules), with_kwargs=True)
    for pattern, specs in outputs.items():
        for target in _modules(module, pattern, "outputs"):
            target.register_forward_hook(_output_hook(specs, mesh, rules))
            if isinstance(specs, (str, Layout)) and isinstance(target, nn.Linear) and not any(target.children()):
                _tell_reduction(target, specs, mesh, rules)


def _modules(module: nn.Module, pattern: str, what: str) -> list[nn.Module]:
    found = [m for n, m in module.named_modules() if fnmatch.fnmatchcase(n, pattern)]
    if not found:
        raise PlanError(f"hp.parallelize: {what} entry '{pattern}' matches no module")
    return found


def _lay(value, spec, mesh, rules):
    if spec is None or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return constrain(value, spec, rules=rules)
    return shard(value, spec, mesh, rules=rules)


def _input_hook(specs, mesh, rules):
    def hook(mod, args, kwargs):
        if isinstance(specs, Mapping):
            kwargs = {k: _lay(v, specs.get(k), mesh, rules) for k, v in kwargs.items()}
        else:
            specs_t = specs if isinstance(specs, tuple) else (specs,)
            args = tuple(_lay(a, s, mesh, rules) for a, s in zip(args, specs_t)) + args[len(specs_t) :]
        return args, kwargs

    return hook


def _output_hook(specs, mesh, rules):
    def hook(mod, args, out):
        if isinstance(out, tuple):
            specs_t = specs if isinstance(specs, tuple) else (specs,)
            return tuple(_lay(o, s, mesh, rules) for o, s in zip(out, specs_t)) + out[len(specs_t) :]
        return _lay(out, specs, mesh, rules)

    return hook


def _tell_reduction(module: nn.Module, spec, mesh, rules) -> None:
    """Inside `hp.mpmd`, a linear's row-parallel kernel learns the layout its output takes, to
    resolve its pending sum chunk by chunk as it multiplies (`hp.ops.overlap.reduce_into`).

    Not for a module with children: adapters (LoRA's) add their own pending sums to its output
    before the one reduction. A pre-hook alone: a compiled block guards on each module's
    always-called hooks, so one of those per layer would compile every layer anew.
    """

    def tell(mod, args):
        if torch.compiler.is_compiling():  # a compiled block's kernels do not pipeline
            return
        weight, x = mod.weight, args[0] if args else None
        if overlap.active() and isinstance(weight, DTensor) and isinstance(x, DTensor):
            shape = (*x.shape[:-1], weight.shape[0])
            overlap.reduce_into(weight, placements_for(spec, mesh, shape, rules))

    module.register_forward_pre_hook(tell)


def _run_in_region(module: nn.Module) -> None:
    if not getattr(module, "_hp_region_hooks", False):
        forward_inside(module, region)
        module._hp_region_hooks = True


def forward_inside(module: nn.Module, context: Callable[[], AbstractContextManager]) -> None:
    """Run every forward of `module` inside a fresh `context()` (exited even on errors)."""
    active: list[AbstractContextManager] = []

    def enter(mod, args, kwargs):
        active.append(context())
        active[-1].__enter__()

    def leave(mod, args, kwargs, out):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)

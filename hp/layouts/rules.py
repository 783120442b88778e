"""Logical axis rules: bind dimension names to mesh axes once, Flax-style.

`with hp.rules(batch="dp", heads="tp"):` makes the layout `"batch s heads d"`
mean `"batch/dp s heads/tp d"` wherever a layout meets a mesh (`hp.shard`,
`hp.constrain`, `hp.parallelize`, ...). Rules bind whole named dimensions; a
dimension that names its axes explicitly (`heads/dp`) keeps them. Two
dimensions of one tensor that end up on one mesh axis are an error, never
resolved silently. Nested `with` blocks extend and override the outer rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from hp.layouts.errors import LayoutError
from hp.layouts.types import Layout

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The active rules, innermost last. A plain stack, not a ContextVar: `torch.compile`
# traces (and guards on) a module global's read, not ContextVar.get.
_ACTIVE: list[Rules] = []


@dataclass(frozen=True)
class Rules:
    """An immutable map from logical dimension names to tuples of mesh axes.

    Usable as a context manager (activates the rules, merged over any outer
    ones) or passed explicitly as `rules=` to the annotate functions.

    >>> import hp
    >>> r = hp.rules(batch="dp", heads="tp", d=None)
    >>> str(r.apply(hp.layout("batch s heads d")))
    'batch/dp s heads/tp d'
    """

    bindings: Mapping[str, tuple[str, ...]]

    def __enter__(self) -> Rules:
        merged = _ACTIVE[-1].merged(self) if _ACTIVE else self
        _ACTIVE.append(merged)
        return merged

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()

    def merged(self, inner: Rules) -> Rules:
        """These rules overridden and extended by `inner`."""
        return Rules(MappingProxyType({**self.bindings, **inner.bindings}))

    def apply(self, layout: Layout) -> Layout:
        """`layout` with every unsplit named dimension bound by these rules."""
        dims = []
        for dim in layout.dims:
            named = not dim.composite and not dim.fused  # rules bind names, not parts
            bound = self.bindings.get(dim.factors[0]) if named else None
            if dim.axes or not bound:
                dims.append(dim)
            else:
                dims.append(replace(dim, axes=bound))
        resolved = tuple(dims)
        if resolved == layout.dims:
            return layout
        try:
            return Layout(resolved, layout.partial, layout.tier)
        except LayoutError as e:
            raise LayoutError(
                f"rules conflict in layout '{layout}': {e.problem} "
                f"(rules: {self})",
                text=e.text,
                span=e.span,
            ) from None

    def __str__(self) -> str:
        return ", ".join(f"{k}={'/'.join(v) or 'None'}" for k, v in self.bindings.items())


def rules(bindings: Mapping[str, str | tuple[str, ...] | None] | None = None, /, **kw) -> Rules:
    """Bind logical dimension names to mesh axes (a str, a tuple of axes, or None).

    >>> import hp
    >>> with hp.rules(batch=("dp", "fsdp")):
    ...     print(hp.layouts.active_rules().apply(hp.layout("batch h")))
    batch/dp/fsdp h
    """
    given = {**(bindings or {}), **kw}
    table: dict[str, tuple[str, ...]] = {}
    for name, axes in given.items():
        if not isinstance(name, str) or not _IDENT.match(name):
            raise LayoutError(f"rules: {name!r} is not a dimension name")
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        if not isinstance(axes, tuple) or not all(isinstance(a, str) and _IDENT.match(a) for a in axes):
            raise LayoutError(
                f"rules: {name}={axes!r} must bind to a mesh axis name, a tuple of them, or None"
            )
        if len(set(axes)) != len(axes):
            raise LayoutError(f"rules: {name}={axes!r} names a mesh axis twice")
        table[name] = axes
    return Rules(MappingProxyType(table))


def active_rules() -> Rules | None:
    """The rules of the innermost active `with hp.rules(...)`, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def resolve(layout: Layout, explicit: Rules | Mapping | None = None) -> Layout:
    """Apply the explicit rules if given, else the active ones, else nothing."""
    chosen = explicit if explicit is not None else active_rules()
    if chosen is None:
        return layout
    if not isinstance(chosen, Rules):
        chosen = rules(chosen)
    return chosen.apply(layout)

"""2D tensor parallel as a strategy: the `TP2D` value, and a family's Megatron plan turned into its layouts.

`hp.tp_plan` says when splitting each linear over two mesh axes (x, y)
moves fewer bytes than Megatron's 1D split; this module makes that a
strategy axis. Nothing here knows a model family: every plan's 1D layouts
translate the same way, so every family with a derived plan runs it.

=================  ==================  ======================
1D (Megatron)      2d and 3d           summa
=================  ==================  ======================
residual stream    `b/y s h/x`          `b/x s h/y`
                   (3d: `b/z/y s h/x`)
`out/tp in`        `out/y in/x`         `out/y in/x`
`out in/tp`        `out/x in/y`         `out/y in/x`
`vocab/tp h`       `vocab/y h/x`        `vocab/y h/x`
`out/tp` (a bias)  `out/y`              `out/y`
=================  ==================  ======================

Between the linears the tokens are split by batch rows over the other axis
(`b/x` inside a 2D block), so attention and the MLP's activation run on a
rank's own rows and heads, and the residual stream splits its rows over y
(and z) and its features over x. A batch's rows must therefore divide by
x and y (times z); the batch axes of the strategy (dp, ep) split the rows
first, cp the sequence as under 1D.

`scheme: auto` picks the scheme and the factorisation of x * y * z ranks
with `hp.tp_plan.choose` from the model's shapes and the tokens a step
runs per group (`TP2D.resolved`); when nothing beats 1D, it is 1D tensor
parallel over the same ranks (`tp`).

The value is plain Python (no torch), like the strategy that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hp.parallel.field_error import FieldError

SCHEMES = ("2d", "summa", "3d", "auto")


class TP2DError(FieldError):
    """A 2D tensor-parallel setting that cannot run: the field at fault, then why."""

    prefix = "tp2d."


@dataclass(frozen=True)
class TP2D:
    """Tensor parallel over two mesh axes `x` and `y` (and a token axis `z` for `3d`), by `scheme`.

    >>> TP2D(x=2, y=4).mesh_axes, TP2D(x=2, y=2, z=2, scheme="3d").ranks
    ({'x': 2, 'y': 4}, 8)
    >>> TP2D.of({"x": 2, "y": 2, "scheme": "summa"}).stream("b/dp", "s")
    'b/dp/x s h/y'
    >>> TP2D(x=1, y=4)
    Traceback (most recent call last):
    ...
    hp.parallel.tp2d.TP2DError: tp2d.x = 1: expected an integer >= 2 (a size-1 axis splits nothing; use tp for 1D)
    """

    x: int
    y: int
    z: int = 1
    scheme: str = "2d"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise TP2DError("scheme", self.scheme, f": expected one of {', '.join(map(repr, SCHEMES))}")
        for key in ("x", "y", "z"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TP2DError(key, value, ": expected an integer >= 1")
        if self.scheme == "auto":
            if self.ranks < 2:
                raise TP2DError("x", self.x, ": auto chooses how to split x * y * z ranks; expected at least 2")
            return
        for key in ("x", "y") + (("z",) if self.scheme == "3d" else ()):
            if getattr(self, key) < 2:
                raise TP2DError(key, getattr(self, key), ": expected an integer >= 2 (a size-1 axis splits "
                                "nothing; use tp for 1D)")
        if self.z > 1 and self.scheme != "3d":
            raise TP2DError("z", self.z, f": only the 3d scheme splits tokens over z; with scheme {self.scheme!r} "
                            "leave z out")

    @classmethod
    def of(cls, spec: TP2D | Mapping[str, Any]) -> TP2D:
        """A TP2D from itself or a mapping of its fields (a config's `tp2d:` section)."""
        if isinstance(spec, TP2D):
            return spec
        if not isinstance(spec, Mapping):
            raise TP2DError("x", spec, ": expected a mapping like {x: 2, y: 2, scheme: 2d}")
        unknown = [k for k in spec if k not in ("x", "y", "z", "scheme")]
        if unknown:
            raise TP2DError(str(unknown[0]), spec[unknown[0]], ": unknown key; expected x, y, z or scheme")
        for key in ("x", "y"):
            if key not in spec:
                raise TP2DError(key, None, ": missing; expected the number of ranks that split along it")
        return cls(**spec)

    @property
    def ranks(self) -> int:
        return self.x * self.y * self.z

    @property
    def rows(self) -> int:
        """What a batch's rows (per data-parallel rank) must be a multiple of: the stream splits them over y
        (and z), a 2D block's middle over x (and z); SUMMA over x alone.

        >>> TP2D(x=2, y=4).rows, TP2D(x=2, y=2, z=2, scheme="3d").rows, TP2D(x=4, y=2, scheme="summa").rows
        (4, 4, 4)
        """
        if self.scheme == "summa":
            return self.x
        return self.z * math.lcm(self.x, self.y)

    @property
    def mesh_axes(self) -> dict[str, int]:
        """The mesh axes, in mesh order (y innermost: it carries the most bytes of a 2D block)."""
        return {**({"z": self.z} if self.scheme == "3d" else {}), "x": self.x, "y": self.y}

    @property
    def row_axes(self) -> tuple[str, ...]:
        """The axes the residual stream splits its rows over (beyond the batch axes)."""
        return {"2d": ("y",), "3d": ("z", "y"), "summa": ("x",)}[self.scheme]

    @property
    def feature_axis(self) -> str:
        """The axis the residual stream splits its features over."""
        return "y" if self.scheme == "summa" else "x"

    def stream(self, rows: str, sequence: str) -> str:
        """The residual stream's layout, given the token layout's rows (`b/dp`) and sequence (`s/cp`)."""
        return f"{'/'.join((rows, *self.row_axes))} {sequence} h/{self.feature_axis}"

    def param_layout(self, megatron: str) -> str:
        """A parameter's layout, from its 1D layout over `tp` (module docstring's table).

        >>> TP2D(x=2, y=2).param_layout("out in/tp"), TP2D(x=2, y=2, scheme="summa").param_layout("out in/tp")
        ('out/x in/y', 'out/y in/x')
        >>> TP2D(x=2, y=2).param_layout("[gate up]/tp in"), TP2D(x=2, y=2).param_layout("out/tp")
        ('[gate up]/y in/x', 'out/y')
        """
        from hp.layouts import layout

        parsed = layout(megatron)
        split = [i for i, d in enumerate(parsed.dims) if d.axes == ("tp",)]
        if len(split) != 1 or len(parsed.dims) > 2 or parsed.partial or any(
                d.axes for i, d in enumerate(parsed.dims) if i not in split):
            raise ValueError(f"{megatron!r}: 2D tensor parallel translates layouts that split one dim of a weight "
                             "or bias over tp, and nothing else")
        if len(parsed.dims) == 1:
            axes = (("y",),)
        elif split == [0] or self.scheme == "summa":  # column-parallel (and every SUMMA weight)
            axes = (("y",), ("x",))
        else:  # row-parallel: back over the other axes
            axes = (("x",), ("y",))
        return str(replace(parsed, dims=tuple(replace(d, axes=a) for d, a in zip(parsed.dims, axes))))

    def resolved(self, config: Any, tokens: int) -> TP2D | None:
        """This value with `auto` decided for an HF config and `tokens` per step of a group (None: 1D
        is cheapest, over `ranks`); a concrete scheme as it is.

        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        ...                      intermediate_size=14336)
        >>> TP2D(x=4, y=4, scheme="auto").resolved(config, tokens=8192)
        TP2D(x=2, y=4, z=2, scheme='3d')
        >>> TP2D(x=2, y=2, scheme="auto").resolved(config, tokens=8192) is None
        True
        """
        if self.scheme != "auto":
            return self
        from hp.parallel.tp_plan import choose

        choice = choose(layer_blocks(config), tokens, self.ranks)
        if choice.scheme == "1d":
            return None
        return TP2D(scheme=choice.scheme, **choice.mesh)


def layer_blocks(config: Any) -> list:
    """`hp.tp_plan`'s blocks of one decoder layer of an HF config (its attention and MLP shapes)."""
    from hp.parallel.tp_plan import layer

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return layer(config.hidden_size, heads, kv, config.intermediate_size, head_dim)

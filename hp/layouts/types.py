"""`Layout` and `Dim`: the immutable value that says how each tensor dimension lies on a mesh.

A layout is written in the notation of docs/notation.md (`"b s/cp h/tp +dp @host"`),
parsed by `hp.layouts.parse`, and printed back here in canonical form. It knows
nothing about a concrete mesh or tensor; `hp.layouts.placements` binds it to
both. Keeping the value type free of torch makes it cheap to hash, compare and
use as a cache key in the op rules above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hp.layouts.errors import LayoutError

TIERS = ("device", "host", "disk")
ELLIPSIS = "..."


@dataclass(frozen=True)
class Dim:
    """One tensor dimension: its name (or composite factors, or fused parts) and the axes that split it.

    `factors` is `("b",)` for a named dim, `("8",)` for an anonymous dim of
    size 8, `("...",)` for the ellipsis, and several names for a composite
    `(a b)` (leftmost factor major). `axes` lists the mesh axes that split the
    dim, major first: `h/x/y` splits over x, then each piece over y.

    A fused dim (`fused=True`, written `[q k v]`) is its parts laid end to end,
    as a packed projection stores them: `factors` names the parts, `sizes`
    gives each part's size when the layout writes them (`[q:64 k:16 v:16]`;
    an anonymous part `16` is its own size), else `()` (equal parts). A split
    applies to every part: `[q k v]/tp` gives rank r piece r of q, of k and of v.
    """

    factors: tuple[str, ...]
    axes: tuple[str, ...] = ()
    composite: bool = False
    fused: bool = False
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Anonymous parts are their sizes: store them, so that `[8 8]` has one form.
        if self.fused and not self.sizes and self.factors and all(f.isdigit() for f in self.factors):
            object.__setattr__(self, "sizes", tuple(int(f) for f in self.factors))

    @property
    def is_ellipsis(self) -> bool:
        return not self.fused and self.factors == (ELLIPSIS,)

    @property
    def size(self) -> int | None:
        """The size written in the layout (anonymous dims only), else None."""
        if not self.composite and not self.fused and self.factors[0].isdigit():
            return int(self.factors[0])
        return None

    def part_sizes(self, size: int) -> tuple[int, ...]:
        """The sizes of a fused dim's parts when the whole dim has `size` (equal unless written).

        >>> Dim(("q", "k", "v"), fused=True).part_sizes(96)
        (32, 32, 32)
        """
        return self.sizes or (size // len(self.factors),) * len(self.factors)

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts as written: `q`, `q:64` or an anonymous size `16`."""
        if not self.sizes:
            return self.factors
        return tuple(f if f.isdigit() else f"{f}:{n}" for f, n in zip(self.factors, self.sizes))

    @property
    def name(self) -> str:
        if self.fused:
            return f"[{' '.join(self.parts)}]"
        body = " ".join(self.factors)
        return f"({body})" if self.composite else body

    def __str__(self) -> str:
        return self.name + "".join(f"/{a}" for a in self.axes)


@dataclass(frozen=True)
class Layout:
    """How a tensor lies on a named mesh; build one with `hp.layout(text)`.

    >>> import hp
    >>> L = hp.layout("b  s/cp h/tp +dp")
    >>> str(L)
    'b s/cp h/tp +dp'
    >>> L.sharded_axes, L.partial
    (('cp', 'tp'), ('dp',))
    """

    dims: tuple[Dim, ...]
    partial: tuple[str, ...] = ()
    tier: str = "device"
    _spans: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "partial", tuple(sorted(self.partial)))
        self._validate()

    # -- printing ---------------------------------------------------------

    def __str__(self) -> str:
        return self._render()[0]

    def __repr__(self) -> str:
        return f"Layout({str(self)!r})"

    def _render(self) -> tuple[str, dict]:
        """Canonical text and the span of each token in it, for caret errors."""
        if self._spans is not None:
            return self._spans["text"], self._spans
        parts: list[str] = []
        spans: dict = {}
        pos = 0

        def emit(token: str, key) -> None:
            nonlocal pos
            if parts:
                pos += 1
            spans[key] = (pos, pos + len(token))
            parts.append(token)
            pos += len(token)

        for i, dim in enumerate(self.dims):
            emit(str(dim), ("dim", i))
            if dim.fused:
                start = spans[("dim", i)][0] + 1
                for k, part in enumerate(dim.parts):
                    spans[("part", i, k)] = (start, start + len(part))
                    start += len(part) + 1
            start = spans[("dim", i)][0] + len(dim.name)
            for j, axis in enumerate(dim.axes):
                spans[("axis", i, j)] = (start + 1, start + 1 + len(axis))
                start += 1 + len(axis)
        for axis in self.partial:
            emit(f"+{axis}", ("partial", axis))
        if self.tier != "device":
            emit(f"@{self.tier}", ("tier",))
        text = " ".join(parts)
        spans["text"] = text
        object.__setattr__(self, "_spans", spans)
        return text, spans

    def error(self, problem: str, at=None) -> LayoutError:
        """A LayoutError whose caret points at token `at` of the canonical text."""
        text, spans = self._render()
        return LayoutError(problem, text=text, span=spans.get(at))

    # -- structure --------------------------------------------------------

    @property
    def rank(self) -> int | None:
        """Number of tensor dims, or None while an ellipsis stands for some."""
        return None if self.has_ellipsis else len(self.dims)

    @property
    def has_ellipsis(self) -> bool:
        return any(d.is_ellipsis for d in self.dims)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """Mesh axes that split some dimension, in the order they appear."""
        return tuple(a for d in self.dims for a in d.axes)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the layout mentions: splits, then partial sums."""
        return self.sharded_axes + self.partial

    def expand(self, shape: tuple[int, ...]) -> Layout:
        """This layout with `...` replaced by anonymous dims of `shape`'s sizes.

        Raises LayoutError when the rank cannot match.
        """
        if not self.has_ellipsis:
            if len(self.dims) != len(shape):
                raise self.error(
                    f"layout has {len(self.dims)} dims but the tensor has "
                    f"{len(shape)} (shape {tuple(shape)})"
                )
            return self
        at = next(i for i, d in enumerate(self.dims) if d.is_ellipsis)
        fixed = len(self.dims) - 1
        if fixed > len(shape):
            raise self.error(
                f"layout needs at least {fixed} dims but the tensor has "
                f"{len(shape)} (shape {tuple(shape)})",
                at=("dim", at),
            )
        n = len(shape) - fixed
        filler = tuple(Dim((str(s),)) for s in shape[at : at + n])
        return replace(self, dims=self.dims[:at] + filler + self.dims[at + 1 :])

    def _validate(self) -> None:
        if self.tier not in TIERS:
            raise self.error(
                f"unknown memory tier '@{self.tier}' (known: {', '.join(TIERS)})",
                at=("tier",),
            )
        seen_names: set[str] = set()
        seen_axes: dict[str, object] = {}
        for i, dim in enumerate(self.dims):
            if dim.is_ellipsis:
                if ELLIPSIS in seen_names:
                    raise self.error("'...' may appear only once", at=("dim", i))
                if dim.axes:
                    raise self.error("'...' cannot be split over a mesh axis", at=("dim", i))
                seen_names.add(ELLIPSIS)
                continue
            if dim.fused:
                self._validate_parts(i, dim)
            for k, name in enumerate(dim.factors):
                if name.isdigit():
                    continue
                if name in seen_names:
                    where = ("part", i, k) if dim.fused else ("dim", i)
                    raise self.error(f"dimension name '{name}' is used twice", at=where)
                seen_names.add(name)
            for j, axis in enumerate(dim.axes):
                if axis in seen_axes:
                    raise self.error(
                        f"mesh axis '{axis}' is used twice in one layout", at=("axis", i, j)
                    )
                seen_axes[axis] = ("axis", i, j)
        for axis in self.partial:
            if axis in seen_axes:
                twice = seen_axes[axis][0] == "partial"
                raise self.error(
                    f"mesh axis '{axis}' is used twice in one layout"
                    if twice
                    else f"mesh axis '{axis}' both splits a dimension and holds a partial sum",
                    at=("partial", axis),
                )
            seen_axes[axis] = ("partial", axis)

    def _validate_parts(self, i: int, dim: Dim) -> None:
        """A fused dim's own rules: some parts, sizes for all of them or none, positive sizes."""
        if dim.composite:
            raise self.error("a dimension is either composite '( )' or fused '[ ]', not both", at=("dim", i))
        if not dim.factors:
            raise self.error("empty fused dimension '[]'", at=("dim", i))
        if dim.sizes and len(dim.sizes) != len(dim.factors):
            raise self.error(
                f"fused dimension has {len(dim.factors)} parts but {len(dim.sizes)} sizes", at=("dim", i)
            )
        for k, name in enumerate(dim.factors):
            if name == ELLIPSIS:
                raise self.error("'...' cannot stand inside a fused dimension", at=("part", i, k))
            if not dim.sizes and name.isdigit():
                raise self.error(
                    "give every part of a fused dimension a size, or none (equal parts)", at=("part", i, k)
                )
            if dim.sizes and dim.sizes[k] <= 0:
                raise self.error(f"part '{name}' has size {dim.sizes[k]}; sizes are positive", at=("part", i, k))
            if dim.sizes and name.isdigit() and int(name) != dim.sizes[k]:
                raise self.error(
                    f"anonymous part '{name}' is its own size, not {dim.sizes[k]}", at=("part", i, k)
                )

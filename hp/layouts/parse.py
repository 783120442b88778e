"""Parser for the layout notation: text in, `Layout` out, caret errors on bad syntax.

Grammar (docs/notation.md says what each form means), einops-style::

    layout  := dim* mark*
    dim     := (NAME | DIGITS | '...' | '(' factor+ ')' | '[' part+ ']') ('/' AXIS)*
    factor  := NAME | DIGITS
    part    := NAME (':' DIGITS)? | DIGITS
    mark    := '+' AXIS          partial sum pending over AXIS
             | '@' TIER          memory tier: device (default), host, disk

`(a b)` is a composite dim (a product of factors, leftmost major); `[q k v]`
is a fused dim (its parts laid end to end, as in a packed qkv projection),
where `q:64` writes a part's size and a bare `16` is an anonymous part of
size 16. Either all parts have a size or none (then they are equal).

Syntax errors point at the character of the original text; semantic errors
(an axis used twice, a repeated name, ...) are raised by `Layout` itself and
point into its canonical form.
"""

from __future__ import annotations

import functools
import re

from hp.layouts.errors import LayoutError
from hp.layouts.types import ELLIPSIS, Dim, Layout

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIGITS = re.compile(r"[0-9]+")


def layout(spec: str | Layout) -> Layout:
    """Parse layout notation into an immutable `hp.Layout` (a Layout passes through).

    >>> import hp
    >>> hp.layout("b s/cp (heads d)/tp +dp @host")
    Layout('b s/cp (heads d)/tp +dp @host')
    >>> hp.layout("[q:64 k:16 v:16] in")
    Layout('[q:64 k:16 v:16] in')
    """
    if isinstance(spec, Layout):
        return spec
    if not isinstance(spec, str):
        raise LayoutError(f"a layout is a string such as 'b s h/tp', got {type(spec).__name__}")
    return _parsed(spec)


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Layout:
    # Layouts are immutable and plans repeat a few texts on every step: parse each once.
    return _Parser(text).parse()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, problem: str, start: int, end: int | None = None) -> LayoutError:
        return LayoutError(problem, text=self.text, span=(start, end or start + 1))

    def skip_spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def word(self, what: str, pattern: re.Pattern = _WORD) -> str:
        m = pattern.match(self.text, self.pos)
        if not m:
            raise self.fail(f"expected {what} here", self.pos)
        self.pos = m.end()
        return m.group()

    def parse(self) -> Layout:
        dims: list[Dim] = []
        partial: list[str] = []
        tier: str | None = None
        marks_started = False
        while True:
            self.skip_spaces()
            c = self.peek()
            if not c:
                break
            start = self.pos
            if c in "+@":
                marks_started = True
                self.pos += 1
                name = self.word("a mesh axis name after '+'" if c == "+" else "a tier name after '@'", _IDENT)
                if c == "+":
                    partial.append(name)
                elif tier is not None:
                    raise self.fail("the memory tier '@' is given twice", start, self.pos)
                else:
                    tier = name
                continue
            if marks_started:
                raise self.fail("dimensions must come before the trailing '+axis' and '@tier' marks", start)
            dims.append(self.dim())
        return Layout(tuple(dims), tuple(partial), tier or "device")

    def dim(self) -> Dim:
        c = self.peek()
        sizes: tuple[int, ...] = ()
        composite = fused = False
        if c == "(":
            factors = self.composite()
            composite = True
        elif c == "[":
            factors, sizes = self.fused()
            fused = True
        elif self.text.startswith(ELLIPSIS, self.pos):
            self.pos += len(ELLIPSIS)
            factors = (ELLIPSIS,)
        elif c in ")]":
            raise self.fail(f"{c!r} without a matching {'(' if c == ')' else '['!r}", self.pos)
        elif c == "/":
            raise self.fail("'/' must follow a dimension name, as in 'h/tp'", self.pos)
        else:
            factors = (self.word("a dimension name, a size, '...', '(' or '['"),)
        axes = []
        while self.peek() == "/":
            self.pos += 1
            if self.peek().isdigit():
                raise self.fail("a mesh axis is named, not numbered: write 'h/tp', not 'h/2'", self.pos)
            axes.append(self.word("a mesh axis name after '/'", _IDENT))
        nxt = self.peek()
        if nxt and not nxt.isspace():
            raise self.fail(f"unexpected character {nxt!r}", self.pos)
        return Dim(factors, tuple(axes), composite, fused, sizes)

    def composite(self) -> tuple[str, ...]:
        open_at = self.pos
        self.pos += 1
        factors: list[str] = []
        while True:
            self.skip_spaces()
            c = self.peek()
            if not c:
                raise self.fail("'(' is never closed", open_at)
            if c == ")":
                self.pos += 1
                break
            if c == "(":
                raise self.fail("composite dimensions cannot nest", self.pos)
            if c == "[":
                raise self.fail("a composite dimension cannot hold a fused one '[ ]'", self.pos)
            if self.text.startswith(ELLIPSIS, self.pos):
                raise self.fail("'...' cannot stand inside a composite dimension", self.pos, self.pos + 3)
            factors.append(self.word("a factor name or size inside '( )'"))
            if self.peek() == "/":
                raise self.fail(
                    "split a composite dimension as a whole: '(a b)/tp', not '(a/tp b)'", self.pos
                )
        if not factors:
            raise self.fail("empty composite dimension '()'", open_at, self.pos)
        return tuple(factors)

    def fused(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """`[q k v]` or `[q:64 k:16 v:16]`: the part names and their sizes (or `()`)."""
        open_at = self.pos
        self.pos += 1
        parts: list[str] = []
        sizes: list[int | None] = []
        unsized: tuple[int, int] | None = None  # the span of the first part without a size
        while True:
            self.skip_spaces()
            c = self.peek()
            if not c:
                raise self.fail("'[' is never closed", open_at)
            if c == "]":
                self.pos += 1
                break
            if c == "[":
                raise self.fail("fused dimensions cannot nest", self.pos)
            if c == "(":
                raise self.fail("a fused part is a name or a size, not a composite '( )'", self.pos)
            if self.text.startswith(ELLIPSIS, self.pos):
                raise self.fail("'...' cannot stand inside a fused dimension", self.pos, self.pos + 3)
            start = self.pos
            part = self.word("a part name or size inside '[ ]'")
            size = self.part_size(part, start) if self.peek() == ":" else None
            size = int(part) if part.isdigit() else size
            if size == 0:
                raise self.fail("a part has size 0; sizes are positive", start, self.pos)
            if self.peek() == "/":
                raise self.fail(
                    "split a fused dimension as a whole: '[q k]/tp' splits every part, not '[q/tp k]'",
                    self.pos,
                )
            nxt = self.peek()
            if nxt and not nxt.isspace() and nxt != "]":
                raise self.fail(f"unexpected character {nxt!r} in a fused dimension", self.pos)
            if size is None and unsized is None:
                unsized = (start, self.pos)
            parts.append(part)
            sizes.append(size)
        if not parts:
            raise self.fail("empty fused dimension '[]'", open_at, self.pos)
        if unsized is not None and any(n is not None for n in sizes):
            raise self.fail("give every part of a fused dimension a size, or none (equal parts)", *unsized)
        return tuple(parts), tuple(n for n in sizes if n is not None)

    def part_size(self, part: str, start: int) -> int:
        """The `64` of `q:64`."""
        if part.isdigit():
            raise self.fail(f"an anonymous part is its size: write '{part}', not '{part}:...'", start, self.pos)
        self.pos += 1
        if not _DIGITS.match(self.text, self.pos):
            raise self.fail("expected a part size after ':', as in 'q:64'", self.pos)
        return int(self.word("a part size", _DIGITS))

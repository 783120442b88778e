"""Parser for the layout notation: text in, `Layout` out, caret errors on bad syntax.

Grammar (DESIGN.md), einops-style::

    layout  := dim* mark*
    dim     := (NAME | DIGITS | '...' | '(' factor+ ')') ('/' AXIS)*
    factor  := NAME | DIGITS
    mark    := '+' AXIS          partial sum pending over AXIS
             | '@' TIER          memory tier: device (default), host, disk

Syntax errors point at the character of the original text; semantic errors
(an axis used twice, a repeated name, ...) are raised by `Layout` itself and
point into its canonical form.
"""

from __future__ import annotations

import re

from hp.layouts.errors import LayoutError
from hp.layouts.types import ELLIPSIS, Dim, Layout

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def layout(spec: str | Layout) -> Layout:
    """Parse layout notation into an immutable `hp.Layout` (a Layout passes through).

    >>> import hp
    >>> hp.layout("b s/cp (heads d)/tp +dp @host")
    Layout('b s/cp (heads d)/tp +dp @host')
    """
    if isinstance(spec, Layout):
        return spec
    if not isinstance(spec, str):
        raise LayoutError(f"a layout is a string such as 'b s h/tp', got {type(spec).__name__}")
    return _Parser(spec).parse()


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
        if c == "(":
            factors = self.composite()
            composite = True
        elif self.text.startswith(ELLIPSIS, self.pos):
            self.pos += len(ELLIPSIS)
            factors, composite = (ELLIPSIS,), False
        elif c == ")":
            raise self.fail("')' without a matching '('", self.pos)
        elif c == "/":
            raise self.fail("'/' must follow a dimension name, as in 'h/tp'", self.pos)
        else:
            factors, composite = (self.word("a dimension name, a size, '...' or '('"),), False
        axes = []
        while self.peek() == "/":
            self.pos += 1
            if self.peek().isdigit():
                raise self.fail("a mesh axis is named, not numbered: write 'h/tp', not 'h/2'", self.pos)
            axes.append(self.word("a mesh axis name after '/'", _IDENT))
        nxt = self.peek()
        if nxt and not nxt.isspace():
            raise self.fail(f"unexpected character {nxt!r}", self.pos)
        return Dim(factors, tuple(axes), composite)

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

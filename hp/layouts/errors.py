"""The one error type of the layout layer, with a caret under the offending token.

Every mistake a user can make in a layout (syntax, an unknown mesh axis, an
indivisible size, a rule conflict, ...) surfaces as `LayoutError`, so callers
catch one type and users read one format: the problem, then the layout text
with a caret under the token that caused it.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout that is malformed or does not fit its tensor, mesh or rules.

    >>> try:
    ...     raise LayoutError("unknown mesh axis 'tq'", text="b h/tq", span=(4, 6))
    ... except LayoutError as e:
    ...     print(e)
    unknown mesh axis 'tq'
      b h/tq
          ^^
    """

    def __init__(
        self,
        problem: str,
        *,
        text: str | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        self.problem = problem
        self.text = text
        self.span = span
        super().__init__(self._render())

    def _render(self) -> str:
        if self.text is None:
            return self.problem
        lines = [self.problem, f"  {self.text}"]
        if self.span is not None:
            start, end = self.span
            lines.append("  " + " " * start + "^" * max(1, end - start))
        return "\n".join(lines)

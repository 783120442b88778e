"""`FieldError`: a field of a typed strategy value (tp2d, a placement) that cannot run.

The strategy names it under its own key (`tp2d.x`, `mpmd.place.vision`), so
each value's error carries the field, the value and why, apart.

>>> str(FieldError("x", 3, ": expected a power of 2"))
'x = 3: expected a power of 2'
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A field at fault (`key`), its `value`, then why (`problem`); `prefix` names the value it belongs to."""

    prefix = ""

    def __init__(self, key: str, value: Any, problem: str) -> None:
        super().__init__(f"{self.prefix}{key} = {value!r}{problem}")
        self.key, self.value, self.problem = key, value, problem

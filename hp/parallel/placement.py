"""Where a model's sub-models run under `hp.mpmd`'s levels 2 and 3: the strategy's `mpmd_place` value.

A vision-language model's vision tower can run as a program of its own
(`hp.mpmd.programs.vision_language`), beside the language model's pipeline
of `pp` stages, one per rank:

- `vision: pp`: spread over the pipeline's own ranks, its work placed in
  the pipeline's bubbles (the world is pp ranks);
- `vision: N`: on N ranks of its own, the last N of the world (the world is
  pp + N ranks), each image's features sent to the first stage.

It is torch-free, like `hp.Strategy`, so that the launcher checks it before
any worker starts.

>>> Placement.of({"vision": "pp"}).own_ranks, Placement.of({"vision": 2}).own_ranks
(0, 2)
>>> Placement.of({"vision": 0})
Traceback (most recent call last):
...
hp.parallel.placement.PlacementError: vision = 0: expected 'pp' (the pipeline's ranks, in its bubbles) or a number of ranks of its own >= 1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hp.parallel.field_error import FieldError

PLACEABLE = ("vision",)  # the sub-models hp train places
SHARED = "pp"  # a sub-model spread over the pipeline's own ranks


class PlacementError(FieldError):
    """A placement that cannot run; `key` names the sub-model."""


@dataclass(frozen=True)
class Placement:
    """Where the vision tower runs: on the pipeline's ranks (`"pp"`) or on that many ranks of its own."""

    vision: int | str

    @classmethod
    def of(cls, spec: Placement | Mapping[str, Any]) -> Placement:
        if isinstance(spec, Placement):
            return spec
        if not isinstance(spec, Mapping) or not spec:
            raise PlacementError("place", spec, ": expected a mapping of sub-models to where they run, e.g. "
                                 "{vision: pp}")
        for key, value in spec.items():
            if key not in PLACEABLE:
                raise PlacementError(str(key), value, f": no sub-model hp train places; expected one of "
                                     f"{', '.join(PLACEABLE)}")
        where = spec["vision"]
        if where != SHARED and (not isinstance(where, int) or isinstance(where, bool) or where < 1):
            raise PlacementError("vision", where, f": expected {SHARED!r} (the pipeline's ranks, in its bubbles) or "
                                 "a number of ranks of its own >= 1")
        return cls(where)

    @property
    def own_ranks(self) -> int:
        """Ranks the placed sub-models hold of their own, beyond the pipeline's."""
        return 0 if self.vision == SHARED else int(self.vision)

    def tower_ranks(self, pp: int) -> tuple[int, ...]:
        """The global ranks the tower runs on, beside a pipeline on ranks 0 .. pp - 1.

        >>> Placement("pp").tower_ranks(2), Placement(1).tower_ranks(2)
        ((0, 1), (2,))
        """
        return tuple(range(pp)) if self.vision == SHARED else tuple(range(pp, pp + self.own_ranks))

"""What each action of an MPMD step costs: measured seconds, not unit time.

PyTorch's pipeline schedules order their actions as if every forward and
backward took one unit of time; a vision tower beside a language model, or a
frozen reference's forward beside a policy's forward and backward, take
very different times, and where their work fits depends on it. A cost table
holds, per stage (`(program, stage)`), its forward's and backward's seconds
per micro-batch, each flow's transfer seconds per micro-batch (its bytes
over the measured bandwidth; a gradient travels back at the same cost), and
each stage's parameter bytes (what data parallel reduces). `measured` builds
one from the runtime's samples of the first steps: the median per key.

>>> costs = Costs({("F", ("lm", 0)): 1.0, ("B", ("lm", 0)): 2.0}, {(("lm", 0), ("lm", 1)): 0.5})
>>> costs.seconds(Action("B", "lm", 0, 3)), costs.moving(("lm", 1), ("lm", 0))
(2.0, 0.5)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hp.mpmd.graph import Action, Graph, Node


@dataclass(frozen=True)
class Costs:
    """Seconds per micro-batch: `compute[(kind, node)]` and `transfer[(src, dst)]` (either direction);
    `param_bytes[node]`: the stage's parameters (its gradient's bytes)."""

    compute: Mapping[tuple[str, Node], float]
    transfer: Mapping[tuple[Node, Node], float] = field(default_factory=dict)
    param_bytes: Mapping[Node, float] = field(default_factory=dict)

    def seconds(self, action: Action) -> float:
        return self.compute.get((action.kind, action.node), 0.0)

    def moving(self, a: Node, b: Node) -> float:
        """Seconds one micro-batch's tensor takes between stages `a` and `b` (0 when neither direction is known)."""
        return self.transfer.get((a, b), self.transfer.get((b, a), 0.0))

    @classmethod
    def unit(cls, graph: Graph) -> Costs:
        """Every forward and backward (and each half of a split one) one unit, transfers free: the time
        PyTorch's schedules assume."""
        return cls({(kind, node): 1.0 for node in graph.nodes() for kind in ("F", "B", "W")})

    @classmethod
    def measured(cls, samples: Iterable[tuple[Action, float]], transfers: Iterable[tuple[Node, Node, float]] = (),
                 *, param_bytes: Mapping[Node, float] | None = None) -> Costs:
        """The median of each stage's forward and backward samples, and of each flow's transfer seconds.

        >>> Costs.measured([(Action("F", "a", 0, 0), 3.0), (Action("F", "a", 0, 1), 1.0)]).compute
        {('F', ('a', 0)): 2.0}
        """
        compute: dict = defaultdict(list)
        for action, seconds in samples:
            compute[action.kind, action.node].append(seconds)
        moved: dict = defaultdict(list)
        for src, dst, seconds in transfers:
            moved[src, dst].append(seconds)
        return cls({k: statistics.median(v) for k, v in compute.items()},
                   {k: statistics.median(v) for k, v in moved.items()}, dict(param_bytes or {}))

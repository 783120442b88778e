"""A placed stage laid out over its tensor parallel group: what crosses between ranks, and its log-probabilities.

Under `hp.mpmd.Placed(planes=tp)` each stage is laid out over the tp ranks
of its graph rank (`hp.apply_strategy`), and the runtime moves plain
tensors point to point, each plane to its counterpart. So a stage hands on
its own block of a laid-out output (`local`) and assembles what it receives
in the stream's layout (`Layout.stream`), as `hp.parallel.pipeline`'s
stages do. The last stage's log-probabilities come from cross-entropy on
the logits as they come back (split by vocabulary under tp: they are never
gathered), with the labels laid along the sequence the same way, and are
then whole on every rank: one number per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hp.layouts import from_local
from hp.ops.region import region
from hp.parallel.apply import stream_layout
from hp.parallel.sequence import IGNORE_INDEX, arrange, shift
from hp.parallel.strategy import Strategy


@dataclass(frozen=True)
class Layout:
    """What a rank's stages are laid out by (`strategy`: tp, sp) on `mesh`, its tensor parallel group's."""

    strategy: Strategy
    mesh: Any

    def stream(self, block: torch.Tensor) -> DTensor:
        """The residual stream assembled from this rank's `block` of it."""
        return from_local(block, stream_layout(self.strategy), self.mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    """What crosses to another rank: a laid-out tensor's own block (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
    """Each row's summed log-probability of its labels (the next token's; -100 not counted), in fp32, whole
    on every rank; `layout`: how laid-out `logits` come back.

    >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
    >>> round(float(sequence_logps(logits, torch.tensor([[-100, 1, 2]]))), 4)  # two labels: 2 log(1/4)
    -2.7726
    """
    targets = arrange(shift(labels), layout.strategy if layout is not None else Strategy(), IGNORE_INDEX)
    with region():
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        sums = -nll.view(targets.shape).sum(-1)
    return sums.full_tensor() if isinstance(sums, DTensor) else sums

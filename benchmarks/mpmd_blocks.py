"""The blocks `mpmd_submeshes.py` runs, and their costs: an emulated block lasts a given time, a real one is
a linear layer; `nominal` makes a stage's cost table from its blocks, `calibrated` measures a real block.

An emulated block is a tiny real layer, so its tensors and gradients are real, whose forward and backward
last the block's cost: the layer's own time counts, the rest is slept to a deadline. Its backward's time
sits on the path autograd takes for each gradient (the input's, the weight's), so a split backward
(`hp.mpmd.backward`) pays each half where it runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from hp.mpmd.backward import input_gradients
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Graph

U = 0.01  # an emulated block's forward, seconds

SPIN = 3e-4  # seconds an emulated action spins before its deadline, rather than oversleep it


class _Lasting(torch.autograd.Function):
    """The identity, whose backward lasts `seconds` (slept to a deadline, the last `SPIN` spun: a sleep wakes
    up to 0.1 ms late): an emulated block's backward time, placed on the path autograd takes for the
    gradient it stands for (the input's or the weight's), so a split backward pays each where it runs."""

    @staticmethod
    def forward(ctx, t, seconds: float):
        ctx.seconds = seconds
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        _until(time.perf_counter() + ctx.seconds)
        return grad, None


def _emulated(x: torch.Tensor, layer: torch.nn.Linear, forward_s: float, backward_s: float) -> torch.Tensor:
    """A tiny real layer, tanh(x W^T + b), whose forward lasts `forward_s` in all (its own time included, the
    rest slept) and whose backward lasts `backward_s`: half for the input's gradient and half for the
    weight's (a linear layer's two products), all of it the weight's when the input wants none."""
    deadline = time.perf_counter() + forward_s
    into_input = backward_s / 2 if x.requires_grad else 0.0
    if x.requires_grad:
        x = _Lasting.apply(x, into_input)
    weight = _Lasting.apply(layer.weight, backward_s - into_input) if layer.weight.requires_grad else layer.weight
    y = torch.tanh(torch.nn.functional.linear(x, weight, layer.bias))
    _until(deadline)
    return y


def _until(deadline: float) -> None:
    if (left := deadline - time.perf_counter() - SPIN) > 0:
        time.sleep(left)
    while time.perf_counter() < deadline:
        pass


class Blocks(torch.nn.Module):
    """`n` blocks: emulated (one tiny linear layer lasting the blocks' time, `_emulated`; `backward` of them
    have a backward, default all) or real (`n` linear layers)."""

    def __init__(self, n: float, width: int, emulated: bool, seed: int, trains: bool = True,
                 backward: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.n, self.emulated, self.backward = n, emulated, n if backward is None else backward
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(1 if emulated else round(n)))
        self.requires_grad_(trains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emulated:
            return _emulated(x, self.layers[0], self.n * U, 2 * self.backward * U)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@dataclass(frozen=True)
class BlockTimes:
    """One block's seconds: its forward, its input's gradient and its weight's (the backward split), its
    backward whole (`whole`; None: the two halves' sum, as an emulated block's), and `saved_first`: what a
    stage whose input wants no gradient saves (a real stage skips its first layer's input gradient; an
    emulated one puts that time on the weight's path). `pieces`: for a micro-batch cut into k parts, a part's
    time over 1/k of the whole's (`pieces[k - 1]`; a real matmul over fewer rows is less efficient)."""

    forward: float = U
    input_grad: float = U
    weight_grad: float = U
    whole: float | None = None
    saved_first: float = 0.0
    pieces: tuple[float, ...] = (1.0,)

    def piece(self, parts: int) -> float:
        """A part's cost factor when each micro-batch is cut into `parts` (1 where not measured)."""
        return self.pieces[parts - 1] if parts <= len(self.pieces) else 1.0


def nominal(graph: Graph, blocks: dict, block: BlockTimes = BlockTimes()) -> Costs:
    """Each stage's costs from its blocks (an emulated block's forward U, its backward 2U: U for its input's
    gradient, U for its weight's); a spread program's part priced at its rows' efficiency."""
    costs = {}
    for node in graph.nodes():
        forward, backward = blocks[node]
        factor = block.piece(graph.program[node[0]].parts)
        costs["F", node] = forward * block.forward * factor
        if graph.splits(node):
            costs["B", node] = backward * block.input_grad * factor
            costs["W", node] = backward * block.weight_grad * factor
        else:
            wants = any(graph.trains(src) for src in graph.inputs(node))
            whole = block.whole if block.whole is not None else block.input_grad + block.weight_grad
            costs["B", node] = (backward * whole - (0 if wants else block.saved_first)) * factor
    return Costs(costs)


def calibrated(width: int, rows: int, parts: int = 2, repeats: int = 21) -> BlockTimes:
    """A real block's times, measured here (per block, the median over `repeats` rounds of 4 blocks, the
    measurements alternating within a round, so that the machine's drift slows them alike): its forward,
    its input's and its weight's gradients (`hp.mpmd.backward`), its backward whole; and for 2 to `parts`
    parts, a micro-batch's part's forward and backward against its share of the whole's."""
    module = Blocks(4, width, emulated=False, seed=0)

    def split() -> tuple[float, float, float]:
        x = torch.randn(rows, width, requires_grad=True)
        start = time.perf_counter()
        out = module(x)
        forward = time.perf_counter()
        later = input_gradients(out, torch.ones_like(out), [x])
        inputs = time.perf_counter()
        later()
        return forward - start, inputs - forward, time.perf_counter() - inputs

    def whole(n: int) -> tuple[float, float]:
        x = torch.randn(n, width, requires_grad=True)
        start = time.perf_counter()
        out = module(x)
        forward = time.perf_counter()
        out.backward(torch.ones_like(out))
        return forward - start, time.perf_counter() - forward

    rounds = [(split(), whole(rows), *(whole(rows // k) for k in range(2, parts + 1)))
              for _ in range(repeats + 2)][2:]

    def median(pick) -> float:
        return statistics.median(pick(r) for r in rounds) / 4

    f, dx, dw = (median(lambda r, i=i: r[0][i]) for i in range(3))
    backward = median(lambda r: r[1][1])
    pieces = (1.0, *(median(lambda r, k=k: k * sum(r[k])) / median(lambda r: sum(r[1])) for k in range(2, parts + 1)))
    return BlockTimes(f, dx, dw, whole=backward, saved_first=dx, pieces=pieces)

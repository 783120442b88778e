"""Choosing tensor parallelism per model: 1D (Megatron), 2D, or token-sharded 3D, by bytes.

A transformer layer is a list of residual blocks; each block is a group of
linears that read one input (q, k, v; or gate, up), a local op (attention
over a rank's heads and sequences; SwiGLU), and one linear back to the
residual width. For T tokens of e-byte elements on p ranks, per rank and per
step (forward + backward):

* 1D: the block's input is replicated, the closing linear leaves a partial
  sum: one all-reduce of T*h forward and one backward.
* 2D on x*y = p (`hp.ops.linear`): the group gathers its input over y and
  reduce-scatters each output over x; the closing linear gathers over x and
  reduce-scatters over y; backward mirrors each step on the other axis.
* SUMMA (Optimus-style 2D) on x*y = p: tokens over x, features over y;
  each linear gathers its input's features over y (shared by a group) and
  its weight's input dim over x; backward reduce-scatters both. It moves
  weight blocks every step, so it wins only when tokens dwarf weights.
* 3D on z*x*y = p: 2D on x*y with tokens also split over z, which divides
  every activation term by z and adds an all-reduce over z of each weight
  block's gradient.

`choose` evaluates every scheme and factorisation and returns the cheapest,
never above 1D (1D is a candidate), with the bytes of each;
`hp.models.llama.choice_layouts` turns a choice into layouts for `hp.parallelize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hp.cost import Bytes


@dataclass(frozen=True)
class Block:
    """A residual branch: linears h -> fan_out (one input), a local op, then mid -> h."""

    name: str
    h: int
    fan_out: tuple[int, ...]
    mid: int

    @property
    def weights(self) -> int:
        return self.h * (sum(self.fan_out) + self.mid)


def square(h: int) -> list[Block]:
    return [Block("square", h, (h,), h)]


def mlp(h: int, ffn: int) -> list[Block]:
    return [Block("mlp", h, (ffn, ffn), ffn)]


def layer(h: int, heads: int, kv_heads: int, ffn: int, head_dim: int | None = None) -> list[Block]:
    """A Llama decoder layer: GQA attention projections, then the SwiGLU MLP."""
    d = head_dim or h // heads
    return [Block("attention", h, (heads * d, kv_heads * d, kv_heads * d), heads * d), *mlp(h, ffn)]


def bytes_1d(blocks: list[Block], tokens: int, p: int, elem: int = 4) -> Bytes:
    cost = Bytes()
    for b in blocks:
        for _ in ("forward", "backward"):
            cost.add("all_reduce", "tp", tokens * b.h * elem, p)
    return cost


def bytes_2d(blocks: list[Block], tokens: int, x: int, y: int, z: int = 1, elem: int = 4) -> Bytes:
    t = tokens // z
    cost = Bytes()
    for b in blocks:
        residual, mid = t * b.h // x * elem, t * b.mid // y * elem  # gathered payloads
        outs = [t * f // y * elem for f in b.fan_out]
        # forward: gather the input over y, scatter each group output over x,
        # gather the closing linear's input over x, scatter its output over y
        cost.add("all_gather", "y", residual, y).add("all_gather", "x", mid, x)
        cost.add("reduce_scatter", "y", residual, y)
        for out in outs:
            cost.add("reduce_scatter", "x", out, x)
        # backward mirrors it: what was gathered is reduce-scattered and vice versa
        cost.add("all_gather", "y", residual, y).add("reduce_scatter", "x", mid, x)
        cost.add("reduce_scatter", "y", residual, y)
        for out in outs:
            cost.add("all_gather", "x", out, x)
        if z > 1:  # weights are replicated over z: their gradients are summed over it
            cost.add("all_reduce", "z", b.weights // (x * y) * elem, z)
    return cost


def bytes_summa(blocks: list[Block], tokens: int, x: int, y: int, elem: int = 4) -> Bytes:
    cost = Bytes()
    for b in blocks:
        for width, outs in ((b.h, b.fan_out), (b.mid, (b.h,))):  # the group, then the closing linear
            features = tokens // x * width * elem  # the gathered input of this step
            cost.add("all_gather", "y", features, y).add("reduce_scatter", "y", features, y)
            for out in outs:
                weight = out // y * width * elem  # the gathered weight block
                cost.add("all_gather", "x", weight, x).add("reduce_scatter", "x", weight, x)
    return cost


@dataclass(frozen=True)
class Decoder:
    """The shapes of a dense decoder that a training step's bytes depend on (RMSNorms, untied head)."""

    layer: tuple[Block, ...]
    layers: int
    vocab: int

    @property
    def h(self) -> int:
        return self.layer[0].h


def step_bytes_2d(model: Decoder, tokens: int, x: int, y: int, elem: int = 4) -> Bytes:
    """Bytes per rank of a 2D training step (forward, backward, gradient sums) of `model` on `tokens`.

    On top of each layer's projections (`bytes_2d`): every RMSNorm (two a layer and the final one)
    all-reduces one number per local row over x, forward and backward; the head (`vocab/y h/x`)
    is a 2D linear whose output is the logits; the vocab-parallel loss all-reduces three numbers per
    row over y; the embedding's output gradient is gathered over y, then x (the table's gradient is
    then whole on every rank); the norms' weights, replicated, sum their gradients over x and y.
    The loss's and the gradient norm's scalars are not counted (tens of bytes).

    >>> step_bytes_2d(Decoder(tuple(layer(64, 4, 4, 128)), 1, 256), tokens=64, x=2, y=2).total
    170624
    """
    h, e = model.h, elem
    cost = Bytes()
    for _ in range(model.layers):
        cost = cost + bytes_2d(list(model.layer), tokens, x, y, 1, e)
    for _ in range(2 * model.layers + 1):  # each norm's sum of squares, forward and backward
        cost.add("all_reduce", "x", tokens // y * e, x).add("all_reduce", "x", tokens // y * e, x)
    stream, logits = tokens * h // x * e, tokens * model.vocab // y * e
    cost.add("all_gather", "y", stream, y).add("reduce_scatter", "x", logits, x)  # the head, forward
    cost.add("all_gather", "x", logits, x).add("reduce_scatter", "y", stream, y)  # and backward
    for _ in range(3):  # row max, sum of exponentials, target logit
        cost.add("all_reduce", "y", tokens // x * e, y)
    cost.add("all_gather", "y", stream, y).add("all_gather", "x", tokens * h * e, x)  # the embedding's gradient
    norms = (2 * model.layers + 1) * h * e
    return cost.add("all_reduce", "x", norms, x).add("all_reduce", "y", norms, y)


def factorisations(p: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of p into `parts` factors, each > 1."""
    if parts == 1:
        return [(p,)] if p > 1 else []
    out = []
    for f in range(2, p + 1):
        if p % f == 0:
            out += [(f, *rest) for rest in factorisations(p // f, parts - 1)]
    return out


@dataclass
class Choice:
    """The cheapest scheme for a model on p ranks, and what it costs against 1D."""

    scheme: str  # "1d", "2d", "summa" or "3d"
    mesh: dict[str, int]
    bytes: int
    bytes_1d: int
    candidates: dict[str, int] = field(default_factory=dict)

    @property
    def reduction(self) -> float:
        return 1 - self.bytes / self.bytes_1d

    def explain(self) -> str:
        best = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(self.candidates.items(), key=lambda kv: kv[1])[:4])
        return (
            f"{self.scheme} on {'x'.join(f'{a}={n}' for a, n in self.mesh.items())}: "
            f"{self.bytes / 2**20:.1f} MiB per rank per step vs {self.bytes_1d / 2**20:.1f} MiB for 1D "
            f"({self.reduction:+.1%} saved); cheapest candidates: {best}"
        )


def choose(
    blocks: list[Block], tokens: int, p: int, elem: int = 4, schemes=("1d", "2d", "summa", "3d")
) -> Choice:
    """The scheme and factorisation with the fewest bytes per rank (1D when nothing beats it).

    >>> c = choose(square(4096), tokens=8192, p=8, schemes=("1d", "2d"))
    >>> c.scheme, c.mesh, round(c.reduction, 3)
    ('2d', {'x': 2, 'y': 4}, 0.429)
    """
    one = bytes_1d(blocks, tokens, p, elem).total
    candidates = {"1d": one}
    if "2d" in schemes:
        for x, y in factorisations(p, 2):
            candidates[f"2d x={x} y={y}"] = bytes_2d(blocks, tokens, x, y, 1, elem).total
    if "summa" in schemes:
        for x, y in factorisations(p, 2):
            candidates[f"summa x={x} y={y}"] = bytes_summa(blocks, tokens, x, y, elem).total
    if "3d" in schemes:
        for z, x, y in factorisations(p, 3):
            if tokens % (z * x * y) == 0:
                candidates[f"3d z={z} x={x} y={y}"] = bytes_2d(blocks, tokens, x, y, z, elem).total
    name = min(candidates, key=lambda k: (candidates[k], k != "1d"))
    scheme, *dims = name.split()
    mesh = {"tp": p} if scheme == "1d" else {k: int(v) for k, v in (d.split("=") for d in dims)}
    return Choice(scheme, mesh, candidates[name], one, candidates)

"""Where a pipeline cuts a model: stages balanced by what each block costs, not by counting layers.

Why: a pipeline step is as slow as its slowest stage. torchtitan's default
split gives every stage the same number of decoder layers and puts the
embedding in the first stage and the head and loss in the last; but the head
and loss of a large-vocabulary model cost what two or three decoder layers
cost (Llama-3-8B: a 128k vocabulary against a 4,096 hidden), so that last
stage runs long while the others wait. Here each piece of the model gets a
cost, forward and backward, from its shapes (`BlockCosts.of`): the FLOPs of
its matmuls over the machine's rate plus the bytes its elementwise work
reads and writes over the machine's bandwidth. `balanced_split` then cuts the
blocks into contiguous stages that minimise the most expensive stage (a
small dynamic program: exact, not greedy), with the embedding fixed to the
first stage and the head and loss to the last. The split is a small frozen
value (`StageSplit`) that prints itself and can be given instead
(`hp.Strategy(pp_split=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A machine's dense matmul rate and memory bandwidth (an H100's, roughly): only their ratio moves a split.
FLOPS = 400e12
BANDWIDTH = 2.0e12
BACKWARD = 2.0  # a backward costs about twice its forward (input and weight gradients)


@dataclass(frozen=True)
class BlockCosts:
    """Seconds per token, forward and backward, of the embedding, each decoder block and the head with its loss.

    >>> from transformers import LlamaConfig
    >>> c = BlockCosts.of(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    ...                               num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32), seq=8192)
    >>> round(c.head / c.blocks[0], 1)  # Llama-3-8B's head and loss against one of its layers
    2.6
    """

    embedding: float
    blocks: tuple[float, ...]
    head: float

    @classmethod
    def of(cls, config: Any, *, seq: int = 4096, recompute: bool = False, dtype_bytes: int = 2) -> BlockCosts:
        """Costs from an HF config (a vision-language one: its decoder's), for sequences of `seq` tokens.

        With `recompute` each block runs its forward twice; the head and loss do not recompute.
        """
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        block = _seconds(_block_flops(config, seq), (16 * h + 4 * _mlp_width(config)) * dtype_bytes)
        # the logits: the head's matmul, then about four float32 passes over V (a fused cross-entropy's
        # max and sum of exponentials, its gradient)
        head = _seconds(2 * h * vocab, 4 * vocab * 4)
        embedding = _seconds(0, 2 * h * dtype_bytes)
        train = 1 + BACKWARD
        return cls(embedding * train, (block * (train + recompute),) * layers, head * train)

    @property
    def total(self) -> float:
        return self.embedding + sum(self.blocks) + self.head


@dataclass(frozen=True)
class StageSplit:
    """Stage s runs blocks `bounds[s]` to `bounds[s + 1] - 1`; the embedding goes with stage 0, the final
    norm, head and loss with the last.

    >>> split = StageSplit.of_counts([3, 5])
    >>> split.blocks(1), split.stages
    (range(3, 8), 2)
    >>> print(split)
    stage 0: embedding, blocks 0-2 | stage 1: blocks 3-7, head
    """

    bounds: tuple[int, ...]

    @classmethod
    def of_counts(cls, counts) -> StageSplit:
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return cls(tuple(bounds))

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def blocks(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def cost(self, costs: BlockCosts, stage: int) -> float:
        """Seconds per token of `stage` under `costs`."""
        own = sum(costs.blocks[i] for i in self.blocks(stage))
        return own + (costs.embedding if stage == 0 else 0) + (costs.head if stage == self.stages - 1 else 0)

    def __str__(self) -> str:
        parts = []
        for s in range(self.stages):
            r = self.blocks(s)
            blocks = f"block {r.start}" if len(r) == 1 else f"blocks {r.start}-{r.stop - 1}"
            what = [*(["embedding"] if s == 0 else []), blocks,
                    *(["head"] if s == self.stages - 1 else [])]
            parts.append(f"stage {s}: {', '.join(what)}")
        return " | ".join(parts)


def even_split(layers: int, stages: int) -> StageSplit:
    """torchtitan's split: the same number of blocks per stage (the first stages take one more when it
    does not divide).

    >>> even_split(8, 4).counts, even_split(7, 2).counts
    ((2, 2, 2, 2), (4, 3))
    """
    _check_fits(layers, stages)
    return StageSplit.of_counts([layers // stages + (s < layers % stages) for s in range(stages)])


def balanced_split(costs: BlockCosts, stages: int) -> StageSplit:
    """The contiguous split of the blocks into `stages` whose most expensive stage costs least.

    >>> costs = BlockCosts(embedding=0.0, blocks=(1.0,) * 8, head=2.5)  # a head and loss of 2.5 layers
    >>> balanced_split(costs, 4).counts  # the last stage gives up blocks for its head
    (2, 2, 3, 1)
    """
    layers = len(costs.blocks)
    _check_fits(layers, stages)
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (costs.embedding if s == 0 else 0) + (costs.head if s == stages - 1 else 0)

    # best[s][b]: the least possible maximum over stages 0..s when they hold blocks 0..b-1; each stage >= 1 block
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(stages)]
    cut = [[0] * (layers + 1) for _ in range(stages)]
    for b in range(1, layers + 1):
        best[0][b] = stage_cost(0, 0, b)
    for s in range(1, stages):
        for b in range(s + 1, layers + 1):
            for a in range(s, b):
                worst = max(best[s - 1][a], stage_cost(s, a, b))
                if worst < best[s][b]:
                    best[s][b], cut[s][b] = worst, a
    bounds, b = [layers], layers
    for s in range(stages - 1, 0, -1):
        b = cut[s][b]
        bounds.append(b)
    return StageSplit(tuple([0, *reversed(bounds)]))


def _check_fits(layers: int, stages: int) -> None:
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for {layers} blocks: each stage needs at least one block; "
                         "lower pp (or the stages per rank)")


def _seconds(flops: float, bytes_moved: float) -> float:
    return flops / FLOPS + bytes_moved / BANDWIDTH


def _mlp_width(config: Any) -> int:
    experts = getattr(config, "num_experts_per_tok", None) or 0
    width = getattr(config, "moe_intermediate_size", None) if experts else None
    return experts * width if width else config.intermediate_size


def _block_flops(config: Any, seq: int) -> float:
    """Forward FLOPs per token of one decoder block: projections, causal attention, the gated MLP."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    projections = 2 * h * d * (2 * heads + 2 * kv)
    attention = 2 * seq * heads * d  # QK^T and AV over half the sequence on average (causal)
    return projections + attention + 3 * 2 * h * _mlp_width(config)

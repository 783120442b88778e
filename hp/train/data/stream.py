"""Examples as batches: the endless, seeded, resumable stream a run trains on, and one pass for evaluation.

Every rank draws the same global batches from the same examples and seed,
with no communication, and a checkpoint's position in the stream resumes
it exactly (`TokenBatches`); evaluation visits every example once, in order
(`eval_batches`). Each batch is a `hp.train.data.batch.Batch`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from hp.train.data.batch import Batch, collate
from hp.train.data.encoding import IGNORE_INDEX
from hp.train.data.examples import Examples
from hp.train.data.vision import Vision


class TokenBatches:
    """An endless, seeded stream of global batches over `examples`, resumable from `state_dict()`.

    Each epoch visits the examples in a fresh order drawn from
    `random.Random` seeded by (seed, epoch) and yields `len(self)` full
    batches; the few examples that do not fill a last batch wait for a
    later epoch's order (every batch has exactly `batch_size` rows, so a dp
    split is always even). The stream yields the *global* batch on every
    rank and the model's strategy slices each rank's part, so all ranks must
    build it with the same examples and seed: they then draw identical
    batches with no communication. `epoch` counts finished epochs (it turns
    over right after an epoch's last batch), so a loop can stop on it; the
    position (epoch, index of the next batch in that epoch) is
    `state_dict()`, and `load_state_dict` of it continues exactly there.

    A batch is a `hp.train.data.batch.Batch`: with `vision` (the examples'), a
    vision-language model's, with their images.

    >>> data = [{"input_ids": [i], "labels": [i]} for i in range(5)]
    >>> batches = TokenBatches(data, batch_size=2, seed=0, pad_id=0)
    >>> len(batches), next(batches).input_ids.shape, batches.state_dict()["index"]
    (2, torch.Size([2, 1]), 1)
    """

    def __init__(
        self,
        examples: Sequence[Mapping[str, list]],
        batch_size: int,
        seed: int,
        pad_id: int,
        *,
        pad_to_multiple_of: int = 1,
        vision: Vision | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples cannot fill one batch of {batch_size}; lower the batch size")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.vision = vision
        self.epoch = 0
        self.index = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation), cached

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.examples) // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.epoch, self.index)
        self.advance()
        return batch

    def batch_at(self, epoch: int, index: int) -> Batch:
        """The `index`-th batch of `epoch`, without moving the stream (a loader's workers collate ahead with it)."""
        order = self._permutation(epoch)
        start = index * self.batch_size
        rows = [self.examples[i] for i in order[start : start + self.batch_size]]
        return collate(rows, self.pad_id, self.pad_to_multiple_of, self.vision)

    def advance(self) -> None:
        """Move to the next batch's position."""
        self.index += 1
        if self.index == len(self):
            self.epoch, self.index = self.epoch + 1, 0

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.examples)))
            # A string seed is hashed (sha512) by random.Random: stable across
            # runs, machines and Python versions, and distinct per (seed, epoch).
            # Its text is part of the seed: kept as runs and checkpoints have it.
            random.Random(f"hp.train.data:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def state_dict(self) -> dict[str, int]:
        """The position, plus what must match for it to mean the same batches on resume."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "batch_size": self.batch_size, "num_examples": len(self.examples)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict()`; refuses one taken over other data, seed or batch size."""
        mine = self.state_dict()
        changed = [f"{k} {state[k]} -> {mine[k]}" for k in ("seed", "batch_size", "num_examples")
                   if k in state and state[k] != mine[k]]
        if changed:
            raise ValueError(f"cannot resume the batch stream: {', '.join(changed)} since it was saved")
        if not 0 <= state["index"] < len(self):
            raise ValueError(f"cannot resume the batch stream: index {state['index']} outside 0..{len(self) - 1}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_batches(examples: Examples, batch_size: int, pad_id: int) -> list[Batch]:
    """Every example once, in order, `batch_size` rows a batch; the last is filled with rows without loss.

    >>> data = Examples([{"input_ids": [1, 2], "labels": [1, 2]}] * 3)
    >>> [labels.tolist() for _, labels in eval_batches(data, 2, pad_id=0)][1]
    [[1, 2], [-100, -100]]
    """
    rows = list(examples.examples)
    rows += [{"input_ids": [pad_id], "labels": [IGNORE_INDEX]}] * (-len(rows) % batch_size)
    return [collate(rows[i : i + batch_size], pad_id, vision=examples.vision) for i in range(0, len(rows), batch_size)]

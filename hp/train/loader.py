"""Batches collated ahead of the step by worker processes (`dataloader_num_workers`).

A global batch is a deterministic function of its position (epoch, index) in
the seeded stream (`hp.train.data.TokenBatches`), so worker processes can
collate the next batches while the step runs (a vision-language batch's
images are read and cut into patches there too) without changing which rows a
step sees: the loader hands batches back in order, and the stream's own
position moves one batch per batch handed out, so checkpoints record the
same position as without workers and a resumed run continues exactly there.
With 0 workers the stream is used as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, Dataset

from hp.train.data import Batch, TokenBatches


class _Positions(Dataset):
    """Map-style view of a stream: item (epoch, index) is that batch."""

    def __init__(self, batches: TokenBatches) -> None:
        self.batches = batches

    def __getitem__(self, position: tuple[int, int]) -> Batch:
        return self.batches.batch_at(*position)


def positions_from(epoch: int, index: int, per_epoch: int) -> Iterator[tuple[int, int]]:
    """The stream's positions (epoch, index) from the given one on, `per_epoch` batches an epoch."""
    while True:
        yield epoch, index
        index += 1
        if index == per_epoch:
            epoch, index = epoch + 1, 0


class Prefetched:
    """`batches`, with `workers` processes collating ahead; the same batches, the same `state_dict()`.

    >>> data = [{"input_ids": [i], "labels": [i]} for i in range(5)]
    >>> plain, ahead = TokenBatches(data, 2, seed=0, pad_id=0), Prefetched(TokenBatches(data, 2, seed=0, pad_id=0), 1)
    >>> import torch
    >>> all(torch.equal(next(plain).input_ids, next(ahead).input_ids) for _ in range(3))
    True
    >>> ahead.state_dict() == plain.state_dict()
    True
    """

    def __init__(self, batches: TokenBatches, workers: int) -> None:
        self.batches = batches
        positions = positions_from(batches.epoch, batches.index, len(batches))
        loader = DataLoader(_Positions(batches), batch_size=None, sampler=positions, num_workers=workers)
        self._ahead = iter(loader)

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> Batch:
        batch = next(self._ahead)
        self.batches.advance()
        return batch

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    def state_dict(self) -> dict[str, int]:
        return self.batches.state_dict()


def loader(batches: TokenBatches, workers: int) -> TokenBatches | Prefetched:
    """The stream the loop draws from: `batches` itself without workers, else a `Prefetched` one."""
    return Prefetched(batches, workers) if workers > 0 else batches

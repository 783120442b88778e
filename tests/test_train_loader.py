"""Batches collated by loader processes are the stream's own batches, and its position stays resumable."""

from __future__ import annotations

import torch

from hp.train.data import TokenBatches
from hp.train.loader import Prefetched, loader

ROWS = [{"input_ids": list(range(1 + i % 5)), "labels": list(range(1 + i % 5))} for i in range(11)]


def stream(**position) -> TokenBatches:
    batches = TokenBatches(ROWS, batch_size=3, seed=7, pad_id=0)
    if position:
        batches.load_state_dict({**batches.state_dict(), **position})
    return batches


def test_two_loader_processes_give_the_same_batches_across_epochs_and_from_a_resumed_position():
    plain, ahead = stream(), Prefetched(stream(), workers=2)
    for _ in range(8):  # 3 batches an epoch: crosses two epoch ends
        want, got = next(plain), next(ahead)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert ahead.state_dict() == plain.state_dict() and ahead.epoch == plain.epoch
    resumed = Prefetched(stream(epoch=2, index=2), workers=2)
    assert all(torch.equal(w, g) for w, g in zip(next(plain), next(resumed)))
    assert resumed.state_dict() == plain.state_dict()


def test_without_workers_the_stream_is_used_as_it_is():
    batches = stream()
    assert loader(batches, 0) is batches and isinstance(loader(batches, 1), Prefetched)

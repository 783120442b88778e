"""A decoding loop's KV cache off the device between its uses, for `hp.offload(..., kv_cache=...)`.

Each layer of a KV cache is defined by its layer's attention in one decoding
step (the new keys and values joined to the old) and used once, by the same
layer, in the next step; in between it only waits. Reads come in layer
order, so the furthest next use is the last layer's: the first `kept`
layers stay on the device and the rest wait in the slow tier. An offloaded
layer is read back while the layer before it computes, and written out as
soon as its attention has it (the write only reads the bytes, so it runs
beside the attention); once the next layer starts, its storage shrinks to
nothing (the tensor keeps its shape, so the cache still knows its length).

At any moment the cache holds its kept layers, the layer computing (its old
and new tensors while they are joined) and the next one read ahead: `kept`
is the most layers that leave room for those two within the budget. The
cache is any object whose `layers` each hold `keys` and `values` tensors,
grown by the cache's `update(keys, values, layer_index, ...)`, as
transformers' `DynamicCache` does (for the step, `update` is wrapped on the
cache object itself); the step must not keep views of the cache past its own layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hp.offload.tiers import DiskTier
from hp.offload.use_def import local_of

_WORKING_LAYERS = 2  # the layer computing (old and new joined) and the next one read ahead


@dataclass(frozen=True)
class CacheRun:
    """One decoding step under the budget: the cache's bytes at most resident, its size, bytes moved."""

    peak_resident_bytes: int
    cache_bytes: int  # the whole cache after the step
    budget_bytes: int
    kept_layers: int
    bytes_offloaded: int
    bytes_read_back: int


class CacheTiering:
    """The layers of `cache` beyond the first few, in `tier` between the steps that use them.

    `budget`: bytes of the cache resident at most, or (a float) that fraction of the whole cache
    as it stands after each step.

    >>> import torch
    >>> from transformers import DynamicCache
    >>> cache = DynamicCache()
    >>> tiering = CacheTiering(cache, DiskTier(), budget=0.5)
    >>> def step(x):  # six layers of a model that only caches
    ...     for i in range(6):
    ...         cache.update(x, x, i)
    >>> for _ in range(3):
    ...     tiering.run(step, (torch.ones(1, 2, 1, 256),), {})
    >>> run = tiering.last_run
    >>> run.kept_layers, run.peak_resident_bytes <= run.budget_bytes, cache.layers[5].keys.shape
    (1, True, torch.Size([1, 2, 3, 256]))
    >>> [layer.keys.untyped_storage().nbytes() > 0 for layer in cache.layers]
    [True, False, False, False, False, False]
    """

    def __init__(self, cache, tier: DiskTier, budget: int | float) -> None:
        self.cache, self.tier, self.budget = cache, tier, budget
        self.away: dict[int, tuple[tuple[int, int], ...]] = {}  # layer -> (tier key, bytes) of its keys, values
        self.reading: set[int] = set()  # away layers whose reads have started: resident from then on
        self.kept: int | None = None  # decided at each step's first update
        self.last_run: CacheRun | None = None

    def run(self, step: Callable, args: tuple, kwargs: dict):
        """`step(*args, **kwargs)` with the cache's layers brought in and put away around their uses."""
        self.kept, self.peak, self.moved_out, self.moved_in = None, 0, 0, 0
        self.budget_bytes = self.budget if isinstance(self.budget, int) else 0
        if 0 in self.away:
            self._prefetch(0)
        self._account()
        self.cache.update = self._wrapped(self.cache.update)  # an attribute of this object only, for this step
        try:
            result = step(*args, **kwargs)
        finally:
            del self.cache.update
        for index in range(len(self.cache.layers)):
            self._free(index)  # the last layer written, and any the step did not reach
        if isinstance(self.budget, float):
            self.budget_bytes = int(self.budget * self._cache_bytes())
        self.last_run = CacheRun(self.peak, self._cache_bytes(), self.budget_bytes, self.kept or 0,
                                 self.moved_out, self.moved_in)
        return result

    def _wrapped(self, update: Callable) -> Callable:
        def update_in_tiers(keys, values, index, *args, **kwargs):
            self._free(index - 1)
            self._bring_in(index)
            old = self._layer_bytes(self.cache.layers[index]) if index < len(self.cache.layers) else 0
            self._account(extra=old + _nbytes(keys) + _nbytes(values))  # old and new, while joined
            out = update(keys, values, index, *args, **kwargs)
            layer = self.cache.layers[index]
            if self.kept is None:
                self._decide(self._layer_bytes(layer))
            if index >= self.kept:
                self._write_out(index)
            if index + 1 in self.away:
                self._prefetch(index + 1)
            self._account()
            return out

        return update_in_tiers

    def _decide(self, layer_bytes: int) -> None:
        """How many leading layers stay, from the size of one layer after this step."""
        layers = len(self.cache.layers)
        if isinstance(self.budget, float):
            self.budget_bytes = int(self.budget * layer_bytes * layers)
        fit = self.budget_bytes // max(layer_bytes, 1) - _WORKING_LAYERS
        self.kept = max(0, min(layers, fit))
        for index in range(max(self.kept, 1), layers):  # layers kept last step that no longer fit
            layer = self.cache.layers[index]
            if index not in self.away and self._layer_bytes(layer):
                self._write_out(index)
                self._free(index)

    def _write_out(self, index: int) -> None:
        """Start writing layer `index`'s keys and values to the tier (its storages stay until `_free`)."""
        layer, written = self.cache.layers[index], []
        for t in (layer.keys, layer.values):
            storage = local_of(t).untyped_storage()
            self.moved_out += storage.nbytes()
            written.append((self.tier.put(storage), storage.nbytes()))
        self.away[index] = tuple(written)

    def _free(self, index: int) -> None:
        """Layer `index`'s storages shrink to nothing once their bytes are written out."""
        if index < 0 or index not in self.away or index in self.reading:
            return
        layer = self.cache.layers[index]
        for t, (key, _) in zip((layer.keys, layer.values), self.away[index]):
            storage = local_of(t).untyped_storage()
            if storage.nbytes():
                self.tier.wait_written(key)
                storage.resize_(0)

    def _prefetch(self, index: int) -> None:
        for key, _ in self.away[index]:
            self.tier.prefetch(key)
        self.reading.add(index)

    def _bring_in(self, index: int) -> None:
        if index not in self.away:
            return
        layer = self.cache.layers[index]
        for t, (key, _) in zip((layer.keys, layer.values), self.away.pop(index)):
            local = local_of(t)
            storage = self.tier.take(key)
            self.moved_in += storage.nbytes()
            local.set_(storage, local.storage_offset(), local.shape, local.stride())
        self.reading.discard(index)

    def _account(self, extra: int = 0) -> None:
        reading = sum(nbytes for i in self.reading for _, nbytes in self.away[i])
        self.peak = max(self.peak, self._cache_bytes(resident=True) + reading + extra)

    def _cache_bytes(self, resident: bool = False) -> int:
        return sum(self._layer_bytes(layer, resident) for layer in self.cache.layers)

    @staticmethod
    def _layer_bytes(layer, resident: bool = True) -> int:
        tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
        if resident:
            return sum(local_of(t).untyped_storage().nbytes() for t in tensors)
        return sum(map(_nbytes, tensors))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

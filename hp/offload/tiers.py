"""Where offloaded tensors wait: the slow memory tiers behind `hp.offload`.

A tier stores one storage's bytes (`put`), reads them back ahead of time
(`prefetch`), and hands back the bytes as a fresh storage (`take`), from
which the caller rebuilds its views. The disk tier writes each storage's
bytes to a file in a private temporary folder with plain writes (not a
mapping: a mapped file faults its pages in one by one, at half the speed,
and they count in the process's memory while mapped), reads them back into a
fresh storage and deletes the file, so CPU-only runs gain memory too: the
process holds the bytes only while they are needed. Writes and reads run in
order on one thread of the tier's own, so the step computes while they move
(the storage being written stays alive until its copy is done, and a read
always follows its write); the kernel's page cache writes the files back
when it needs the memory. Its bandwidth is measured once (a write and a read
of a few MB) so that the planner can lead prefetches by real transfer times.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_PROBE_BYTES = 8 << 20


class DiskTier:
    """Storages as files under a temporary folder (or `directory`), written and read on one thread.

    >>> tier = DiskTier()
    >>> key = tier.put(torch.arange(6.0).untyped_storage())
    >>> tier.prefetch(key)
    >>> torch.empty(0).set_(tier.take(key)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> tier.close()
    """

    name = "disk"
    copy_share = 1.0  # the share of its copy time the step pays: its copies run on the cores the step uses

    def __init__(self, directory: str | None = None) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="hp-offload-", dir=directory)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-offload-io")
        self._pending: dict[int, Future] = {}
        self._sizes: dict[int, int] = {}
        self._devices: dict[int, torch.device] = {}
        self._written: dict[int, Future] = {}
        self._next = 0

    def put(self, storage: torch.UntypedStorage) -> int:
        """Start writing `storage`'s bytes out; a key to read them back with."""
        key, self._next = self._next, self._next + 1
        self._sizes[key] = storage.nbytes()
        self._devices[key] = storage.device
        self._written[key] = self._io.submit(self._write, key, storage)
        return key

    def wait_written(self, key: int) -> None:
        """Return once `key`'s bytes are out (its storage may then be freed)."""
        written = self._written.get(key)
        if written is not None:
            written.result()

    def _write(self, key: int, storage: torch.UntypedStorage) -> None:
        if storage.device.type != "cpu":  # an accelerator's bytes pass through host memory
            storage = storage.cpu()
        with open(self._path(key), "wb", buffering=0) as f:
            view, done = _bytes_of(storage), 0
            while done < len(view):
                done += f.write(view[done:])

    def prefetch(self, key: int) -> None:
        """Start reading `key` back on the tier's thread (once), after its write."""
        if key not in self._pending:
            self._pending[key] = self._io.submit(self._read, key)

    def take(self, key: int) -> torch.UntypedStorage:
        """The bytes of `key` as a fresh storage (waits for its prefetch, or reads now)."""
        self.prefetch(key)
        return self._pending.pop(key).result()

    def _read(self, key: int) -> torch.UntypedStorage:
        self._written.pop(key, None)  # this thread wrote it before this read
        path, size = self._path(key), self._sizes.pop(key)
        storage = torch.empty(size, dtype=torch.uint8).untyped_storage()
        with open(path, "rb", buffering=0) as f:
            view, done = _bytes_of(storage), 0
            while done < size:
                got = f.readinto(view[done:])
                if not got:  # a cut file would otherwise be read forever
                    raise OSError(f"hp.offload: {path} holds {done} of its {size} bytes; the tier's file was cut short")
                done += got
        os.unlink(path)
        device = self._devices.pop(key)
        if device.type != "cpu":
            storage = torch.empty(0, dtype=torch.uint8).set_(storage).to(device).untyped_storage()
        return storage

    def _path(self, key: int) -> str:
        return os.path.join(self._folder.name, f"{key}.bin")

    def bandwidth(self) -> float:
        """Bytes per second of a write and a read of `_PROBE_BYTES` (the slower of the two)."""
        probe = torch.zeros(_PROBE_BYTES, dtype=torch.uint8).untyped_storage()
        start = time.perf_counter()
        key = self.put(probe)
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        self.take(key)
        read = time.perf_counter() - start
        return _PROBE_BYTES / max(wrote, read, 1e-9)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._pending.clear()
        self._folder.cleanup()


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    """The storage's memory as bytes for file I/O, without a numpy view (which would fix its size)."""
    if storage.nbytes() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")

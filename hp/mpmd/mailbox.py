"""Tensors between two ranks of an MPMD step, each behind the envelope that says its shape.

A receiver cannot size a tensor before it knows its shape, so every tensor
travels behind a fixed-size envelope: the dtype, the shape and, for a tensor
of at most `INLINE` bytes (a log-probability per sequence, a loss, a small
activation), the tensor itself. A small tensor is then one message; a
larger one is its envelope and then its data.

The tensors cross on a gloo group (`CHANNEL_BACKEND`) through host memory,
on accelerators too. A plan sends between two ranks on several flows, in
an order of its own on each rank, and only tags tell the messages apart:
nccl and hccl ignore tags and match a pair's messages in the order they
are posted, on one stream for both directions, so a receive posted before
the peer's matching send (or a send queued behind a receive) mismatches or
hangs. gloo honours tags.

gloo, like MPI's rendezvous protocol, moves a message only once its receive
is posted: a receive posted when its reader starts costs a round trip on the
critical path. The runtime therefore tells the mailbox, a few actions
ahead, which envelopes it will read (`expect`); their receives are posted at
once, and an envelope sent meanwhile lands while the actions before its
reader run. Between actions the runtime lets the mailbox open what has
landed (`progress`): a larger tensor's data receive is posted as soon as its
envelope says its shape, so the data too crosses while the rank computes.
`take` then waits for what is still in flight.

>>> box = Mailbox(group=None, device="cpu")
>>> box.pending
0
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

CHANNEL_BACKEND = "gloo"  # the backend of the groups the tensors cross on
INLINE = 4096  # bytes: a tensor up to this size travels inside its envelope
_META = 8  # int64s: dtype code, ndim, then the shape (at most 6 dimensions)
_ENVELOPE = _META * 8 + INLINE  # bytes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)


class Mailbox:
    """Sends and receives tensors with their envelopes on gloo process group `group` (None: the world),
    peers by group rank; received tensors land on `device`. `waited` adds up the seconds spent waiting in
    `take`."""

    def __init__(self, group: Any, device: torch.device | str) -> None:
        self.group, self.device = group, torch.device(device)
        self.waited = 0.0
        self._posted: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # (peer, tag) -> envelope, its receive
        self._opened: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # (peer, tag) -> tensor, its data's receive

    @property
    def pending(self) -> int:
        """Envelopes whose receives are posted and not yet taken."""
        return len(self._posted) + len(self._opened)

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> list:
        """Send `tensor` to `peer` with tags `tag` (the envelope) and `tag + 1` (the data, when it does not fit
        inside); what must be waited on, and kept alive, until the sends complete."""
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dim() > _META - 2:
            raise ValueError(f"mpmd: a tensor of {tensor.dim()} dimensions between stages (at most {_META - 2})")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"mpmd: a {tensor.dtype} tensor between stages; an envelope carries "
                             f"{', '.join(str(d) for d in _DTYPES)}")
        meta = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (_META - 2 - tensor.dim())
        nbytes = tensor.numel() * tensor.element_size()
        inline = nbytes <= INLINE
        envelope = _envelope(meta, tensor if inline else None)
        global_peer = self._global(peer)
        works = [dist.isend(envelope, global_peer, group=self.group, tag=tag)]
        if not inline:
            works.append(dist.isend(tensor, global_peer, group=self.group, tag=tag + 1))
        return works + [_Keep(envelope, tensor)]

    def expect(self, peer: int, tag: int) -> None:
        """Post the receive of the envelope `peer` sends with `tag`, if not posted yet."""
        if (peer, tag) not in self._posted:
            envelope = torch.empty(_ENVELOPE, dtype=torch.uint8)
            self._posted[peer, tag] = envelope, dist.irecv(envelope, self._global(peer), group=self.group, tag=tag)

    def progress(self) -> None:
        """Open every envelope that has landed: post its data's receive (it moves only once posted)."""
        for key in [key for key, (_, work) in self._posted.items() if work.is_completed()]:
            envelope, work = self._posted.pop(key)
            work.wait()  # done: raises if the receive failed
            self._opened[key] = self._open(envelope, *key)

    def take(self, peer: int, tag: int) -> torch.Tensor:
        """The tensor `peer` sent with `tag`, waiting for what has not arrived."""
        start = time.perf_counter()
        opened = self._opened.pop((peer, tag), None)
        if opened is None:  # not landed, or not looked at since
            self.expect(peer, tag)
            envelope, work = self._posted.pop((peer, tag))
            work.wait()
            opened = self._open(envelope, peer, tag)
        out, data = opened
        if data is not None:
            data.wait()
        self.waited += time.perf_counter() - start
        return out.to(self.device)

    def _open(self, envelope: torch.Tensor, peer: int, tag: int) -> tuple[torch.Tensor, Any]:
        """The tensor an envelope announces, and its data's receive (None: it came inside)."""
        code, ndim, *shape = envelope[:_META * 8].view(torch.int64).tolist()
        out = torch.empty(shape[:ndim], dtype=_DTYPES[code])
        nbytes = out.numel() * out.element_size()
        if nbytes <= INLINE:
            out.reshape(-1).view(torch.uint8).copy_(envelope[_META * 8:_META * 8 + nbytes])
            return out, None
        return out, dist.irecv(out, self._global(peer), group=self.group, tag=tag + 1)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer


def _envelope(meta: list[int], tensor: torch.Tensor | None) -> torch.Tensor:
    """The envelope's bytes: `meta` as int64s, then host tensor `tensor`'s bytes (None: none), zero-padded; one
    buffer built in Python (a handful of torch ops would cost more than the send)."""
    head = torch.tensor(meta, dtype=torch.int64).view(torch.uint8).numpy().tobytes()
    body = b"" if tensor is None else tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return torch.frombuffer(bytearray(head + body + bytes(INLINE - len(body))), dtype=torch.uint8)


class _Keep:
    """Holds sent tensors until the sends are waited for (`isend` does not keep them alive)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = ()

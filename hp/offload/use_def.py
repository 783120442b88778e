"""Use-definition chains of a training step: what autograd keeps, from where to where.

`hp.offload` plans from these. One recorded call of the step sees every
tensor autograd saves for backward (through `saved_tensors_hooks`): where it
is defined (the forward event that saves it, in the module that runs then)
and where it is used (the backward events that read it back), with its bytes
and the wall time of every event, and, between events, the most memory the
step's own storages took (a dispatch mode sees every op's outputs: saved or
not, activations, gradients, optimizer states), so that a budget can be the
step's whole memory. Storage saved twice (an input two ops
keep) is one tensor: it occupies memory once. What existed before the step
and outlives it (parameters, buffers, the step's own inputs, and views of
them) is recorded as kind "input": offloading it frees nothing, since its
owner still holds it. Parameters are known as `nn.Parameter`s (and leaves
that require grad), plus the parameters and buffers of the modules passed.

A DTensor is recorded by its local block, the bytes this rank holds.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class SavedTensor:
    """One storage autograd keeps for backward: its size, definition and uses (event indices)."""

    index: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "activation" (made by the step) or "input" (held by its owner anyway)
    defined_at: int
    defined_in: str  # the innermost module running when it was saved ("" outside any)
    uses: list[int] = field(default_factory=list)

    @property
    def last_use(self) -> int:
        """The event after which autograd no longer needs it (its definition if never read)."""
        return self.uses[-1] if self.uses else self.defined_at


@dataclass(frozen=True)
class Block:
    """A module the step may recompute instead of keeping what it saves: its name and forward time."""

    name: str
    forward_s: float  # its forward's wall time in the recorded call (summed over its calls)
    input_index: int | None = None  # the saved tensor that is its input (recompute keeps it), if any

    def holds(self, t: SavedTensor) -> bool:
        """Whether `t` was saved inside this block."""
        return t.defined_in == self.name or t.defined_in.startswith(self.name + ".")


@dataclass
class Recording:
    """The saved tensors of one step, and when each event (a save or a read) happened."""

    tensors: list[SavedTensor]
    event_times: list[float]  # seconds since the step started, one per event
    backward_start: int  # the first read event (events before it are forward saves)
    # the most bytes of storage the step had created and not freed, from each event to the next
    # (activations, temporaries, gradients, optimizer states alike); empty when not measured
    step_bytes: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)  # the recompute candidates, in forward order

    def other_bytes(self) -> list[int]:
        """Per event, the step's memory that is not saved activations (what offload cannot move)."""
        if not self.step_bytes:
            return [0] * len(self.event_times)
        return [max(0, total - act) for total, act in zip(self.step_bytes, self.resident_bytes())]

    @property
    def step_peak_bytes(self) -> int:
        """The step's own peak memory (every storage it created), or the saved activations' peak."""
        return max(self.step_bytes, default=0) or self.peak_bytes

    def resident_bytes(self, away: Mapping[int, int] | None = None) -> list[int]:
        """Activation bytes on the device after each event.

        Tensors in `away` (index -> the event it is read back at) leave once saved (resident for
        their defining event only) and are back from that event until their last use.
        """
        away = away or {}
        delta = [0] * (len(self.event_times) + 1)
        for t in self.activations():
            delta[t.defined_at] += t.nbytes
            if t.index in away:
                delta[t.defined_at + 1] -= t.nbytes
                delta[away[t.index]] += t.nbytes
            delta[t.last_use + 1] -= t.nbytes
        out, level = [], 0
        for d in delta[:-1]:
            level += d
            out.append(level)
        return out

    def activations(self) -> list[SavedTensor]:
        return [t for t in self.tensors if t.kind == "activation"]

    @property
    def peak_bytes(self) -> int:
        return max(self.resident_bytes(), default=0)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The block of `t` this rank holds."""
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the storage behind `t` (views of one storage share it) while it lives.

    The storage object, not its address: FSDP shrinks a block's gathered parameters to nothing
    after its forward, and the next block's gather may then take the same address.
    """
    local = local_of(t)
    return (local.device, id(local.untyped_storage()))


class _Allocations(TorchDispatchMode):
    """Bytes of the storages ops create that are still alive, and the most since the last look.

    An infra mode, as torch's own tracing modes are: dynamo runs compiled code under it (under a
    user's dispatch mode it would skip every compiled frame, and `fullgraph=True` would fail), so
    a recorded step saves what its compiled blocks save on every later call. The buffers a
    compiled graph allocates inside its own kernels pass unseen; what it returns is seen.
    """

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.live = self.high = self.looks = 0
        self._seen: dict[tuple, tuple[int, int]] = {}  # live storage (`storage_key`) -> (bytes, looks before it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(local_of(t))
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            key, storage = storage_key(t), t.untyped_storage()
        except RuntimeError:  # a wrapper with no storage of its own (a collective's pending result)
            return
        if key in self._seen or storage.device.type == "meta":
            return
        self._seen[key] = (storage.nbytes(), self.looks)
        self.live += storage.nbytes()
        self.high = max(self.high, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: tuple, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def look(self) -> int:
        """The most bytes alive since the previous look."""
        self.looks += 1
        high, self.high = self.high, self.live
        return high

    def survivors(self) -> list[tuple[int, int]]:
        """(bytes, looks before it was made) of every storage still alive."""
        return list(self._seen.values())


class Recorder:
    """Saved-tensor hooks and a module tracker that build a `Recording` of one step.

    >>> import torch
    >>> layer = torch.nn.Linear(4, 4)
    >>> with Recorder() as rec:
    ...     layer(torch.ones(2, 4).relu()).tanh().sum().backward()
    >>> [(t.kind, t.nbytes, t.defined_in) for t in rec.recording().tensors]
    [('activation', 32, 'Linear'), ('activation', 32, '')]
    """

    def __init__(self) -> None:
        self._tensors: list[SavedTensor] = []
        self._by_storage: dict[tuple, SavedTensor] = {}
        self._times: list[float] = []
        self._modules: list[str] = []
        self._backward_start: int | None = None
        self._names: dict[int, str] = {}
        self._inputs: set[tuple] = set()
        self._blocks: dict[int, str] = {}  # id(module) -> name, of the recompute candidates
        self._open: list[tuple[str, float, tuple | None]] = []  # blocks running: (name, start, input storage)
        self._spans: dict[str, list] = {}  # block name -> [forward seconds, input storage]

    def _event(self) -> int:
        self._times.append(time.perf_counter() - self._start)
        self._totals.append(self._allocations.look())
        return len(self._times) - 1

    def pack(self, t: torch.Tensor) -> tuple[SavedTensor, torch.Tensor]:
        key = storage_key(t)
        seen = self._by_storage.get(key)
        if seen is not None:
            return seen, t  # each save keeps its own view of the storage
        local = local_of(t)
        kind = "input" if key in self._inputs or _is_parameter(t) else "activation"
        saved = SavedTensor(
            index=len(self._tensors), nbytes=local.untyped_storage().nbytes(), shape=tuple(t.shape), dtype=t.dtype,
            kind=kind, defined_at=self._event(), defined_in=self._modules[-1] if self._modules else "",
        )
        self._tensors.append(saved)
        self._by_storage[key] = saved
        # once freed, its address may hold another storage (FSDP's next all-gather, say): a new tensor
        weakref.finalize(local.untyped_storage(), self._forget, key, saved)
        return saved, t

    def _forget(self, key: tuple, saved: SavedTensor) -> None:
        if self._by_storage.get(key) is saved:
            del self._by_storage[key]

    def unpack(self, handle: tuple[SavedTensor, torch.Tensor]) -> torch.Tensor:
        saved, t = handle
        event = self._event()
        if self._backward_start is None:
            self._backward_start = event
        saved.uses.append(event)
        return t

    def __enter__(self) -> Recorder:
        self._start = time.perf_counter()
        self._totals: list[int] = []
        self._allocations = _Allocations()
        self._allocations.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        self._module_hooks = (
            nn.modules.module.register_module_forward_pre_hook(self._enter_module),
            nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True),
        )
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._allocations.__exit__(*exc)
        self._end_total = self._allocations.look()
        self._survivors = self._allocations.survivors()
        for hook in self._module_hooks:
            hook.remove()

    def _enter_module(self, module: nn.Module, args) -> None:
        self._modules.append(self._names.get(id(module)) or type(module).__name__)
        if id(module) in self._blocks:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._open.append((self._blocks[id(module)], time.perf_counter(),
                               storage_key(first) if first is not None else None))

    def _leave_module(self, module: nn.Module, args, out) -> None:
        if self._modules:
            self._modules.pop()
        if id(module) in self._blocks and self._open:
            name, start, key = self._open.pop()
            span = self._spans.setdefault(name, [0.0, key])
            span[0] += time.perf_counter() - start

    def know(self, roots: tuple[nn.Module, ...], tensors: list, blocks: tuple[nn.Module, ...] = ()) -> None:
        """Name definitions by the modules' qualified names in `roots` (else by class name); their
        parameters and buffers, and `tensors`, are inputs; `blocks` are timed as recompute candidates."""
        for root in roots:
            for name, module in root.named_modules():
                self._names[id(module)] = name or type(root).__name__
        for block in blocks:
            self._blocks[id(block)] = self._names.get(id(block)) or f"{type(block).__name__}#{len(self._blocks)}"
        for root in roots:
            self._inputs.update(storage_key(t) for t in (*root.parameters(), *root.buffers()))
        self._inputs.update(storage_key(t) for t in tensors if isinstance(t, torch.Tensor))

    def recording(self) -> Recording:
        start = self._backward_start if self._backward_start is not None else len(self._times)
        # step_bytes[e] covers the span after event e, which the (e+1)-th look closes
        step_bytes = list(self._totals[1:]) + [self._end_total]
        # What outlives the step (optimizer states made on a first step, the result) is held
        # before the next one: the step's own memory leaves it out from where it was made.
        for nbytes, made in self._survivors:
            for e in range(max(made - 1, 0), len(step_bytes)):
                step_bytes[e] -= nbytes
        blocks = []
        for name, (seconds, key) in self._spans.items():
            saved = self._by_storage.get(key)
            blocks.append(Block(name, seconds, saved.index if saved is not None and saved.kind == "activation" else None))
        return Recording(list(self._tensors), list(self._times), start, step_bytes, blocks)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def record(step: Callable, args: tuple, kwargs: dict, modules: tuple[nn.Module, ...] = (),
           blocks: tuple[nn.Module, ...] = ()) -> tuple[object, Recording]:
    """Run `step(*args, **kwargs)` once; its result and the use-definition chains of what it saved
    (with the forward time of each of `blocks`)."""
    with Recorder() as recorder:
        recorder.know(modules, tree_leaves((args, kwargs)), blocks)
        result = step(*args, **kwargs)
    return result, recorder.recording()

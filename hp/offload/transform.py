"""`hp.offload(step)`: a training step whose saved activations fit a memory budget.

The step is any function that runs a forward and a backward (and usually an
optimizer update). Its first call runs it as it is while recording the
use-definition chains of everything autograd saves (`hp.offload.use_def`); the
planner (`hp.offload.plan`) then decides which activations leave the device
for a slower tier (`hp.offload.tiers`) and when each comes back. Every later
call runs the plan: in forward, an offloaded activation is written out as
autograd saves it; in backward, reads start at their planned events on the
tier's reader thread, and each tensor is rebuilt, view and all (a DTensor
with its spec), when autograd asks for it. The values are the same bytes, so
losses and gradients are bit-identical to the step without offload.

The k-th storage saved in a call is matched to the k-th of the recording; a
call that saves something else (another input shape, say) keeps everything
from there on and is recorded again, and the next call is planned anew.

On CPU the device is host memory, so the slow tier is the disk; the host
tier (pinned memory and a copy stream) is for accelerators and is not built
yet. Saved activations are planned; optimizer states, when the optimizer is
given, wait in the tier between updates, and so does a decoding step's KV
cache (`hp.offload.cache`); given candidate blocks, the planner recomputes
those whose recompute costs less than moving what they save. Parameters and
gradients stay where they are.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor

from hp.device import detect
from hp.offload.cache import CacheRun, CacheTiering
from hp.offload.plan import OffloadPlan, choose_recompute, plan_offload
from hp.offload.states import OptimizerStates
from hp.offload.tiers import DiskTier
from hp.layouts.specs import new_dtensor
from hp.parallel.recompute import is_recomputed, keep_activations, recompute
from hp.offload.use_def import Recording, local_of, record, storage_key

SLOW_TIERS = ("host", "disk")


class OffloadError(ValueError):
    """An offload request that cannot be honoured: a bad budget, or a tier this machine lacks."""


def offload(
    step: Callable,
    *,
    budget: int | float,
    tiers: Sequence[str] = ("device", "disk"),
    modules: Sequence[nn.Module] = (),
    optimizer: torch.optim.Optimizer | None = None,
    kv_cache: object | None = None,
    recompute: Sequence[nn.Module] = (),
    bandwidth: float | None = None,
    directory: str | None = None,
) -> Offloaded:
    """`step` whose own memory stays under `budget` (bytes, or a fraction of its recorded peak).

    The budget counts what the step allocates above what was held before it: saved activations
    (which offload moves), temporaries, gradients and optimizer states (which it does not).

    `modules` (the model) name definitions in the plan and mark their parameters and buffers as
    inputs; with `optimizer`, its states wait in the slow tier between its updates
    (`hp.offload.states`); `directory` is where the disk tier writes (a temporary folder by default).

    `recompute` lists blocks of `modules` (decoder layers, say) the planner may recompute in
    backward instead of moving what they save, where that costs less time
    (`hp.offload.plan.choose_recompute`); a block it picks is recomputed from then on
    (`hp.parallel.recompute`) and the next call is recorded anew; should that recording hold more than the
    plan expected, the block keeps its activations again and is not picked again. `bandwidth`
    (bytes per second) replaces the tier's measured one, for a disk other work shares, say.

    With `kv_cache` (a decoding step's cache, such as transformers' `DynamicCache`), the budget is
    the cache's instead: at most that many of its bytes resident at any moment (a float: that
    fraction of the whole cache after each call), its later layers waiting in the slow tier between
    the calls that use them (`hp.offload.cache`); nothing is recorded, and `last_run` is a
    `CacheRun`.

    >>> import torch, hp
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    >>> def train_step(x):
    ...     loss = model(x).square().mean()
    ...     loss.backward()
    ...     return loss.detach()
    >>> step = hp.offload(train_step, budget=0.9, modules=[model])
    >>> first = step(torch.ones(4096, 64))   # runs as is, records, plans
    >>> second = step(torch.ones(4096, 64))  # runs the plan
    >>> plan = step.plan()
    >>> plan.peak_after <= plan.budget_bytes < plan.peak_before, step.last_run.bytes_offloaded > 0
    (True, True)
    """
    tiers = tuple(tiers)
    if not tiers or tiers[0] != "device" or len(tiers) != 2 or tiers[1] not in SLOW_TIERS:
        raise OffloadError(f"hp.offload: tiers={tiers!r}: expected ('device', T) with T one of {SLOW_TIERS}")
    if tiers[1] == "host":
        where = detect().type
        raise OffloadError(
            "hp.offload: the host tier is not built yet" + (" (and on CPU the device is host memory)"
                                                            if where == "cpu" else "") + "; use tiers=('device', 'disk')"
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise OffloadError(f"hp.offload: budget={budget!r}: expected bytes (an int > 0) or a fraction of the "
                           "recorded peak (a float in (0, 1])")
    if isinstance(budget, float) and budget > 1:
        raise OffloadError(f"hp.offload: budget={budget!r}: a float budget is a fraction of the peak, at most 1.0")
    if kv_cache is not None and not (hasattr(kv_cache, "layers") and callable(getattr(kv_cache, "update", None))):
        raise OffloadError(f"hp.offload: kv_cache={type(kv_cache).__name__}: expected a cache with "
                           "update(keys, values, layer_index) and layers that hold keys and values "
                           "(transformers' DynamicCache)")
    if kv_cache is not None and optimizer is not None:
        raise OffloadError("hp.offload: kv_cache= is for a decoding step and optimizer= for a training step; "
                           "give one of them")
    if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                  or not bandwidth > 0):
        raise OffloadError(f"hp.offload: bandwidth={bandwidth!r}: expected bytes per second, a number > 0")
    known = {id(m) for root in modules for m in root.modules()}
    for i, block in enumerate(recompute):
        if not isinstance(block, nn.Module) or id(block) not in known:
            raise OffloadError(f"hp.offload: recompute[{i}] ({type(block).__name__}) is not a module of `modules`: "
                               "expected blocks of the model passed as modules=[model]")
    return Offloaded(step, budget, tuple(modules), optimizer=optimizer, kv_cache=kv_cache, blocks=tuple(recompute),
                     bandwidth=bandwidth, directory=directory)


class Offloaded:
    """A step under `hp.offload`: call it as the step; `plan()` shows what it does."""

    def __init__(self, step: Callable, budget: int | float, modules: tuple[nn.Module, ...], *,
                 optimizer: torch.optim.Optimizer | None, kv_cache: object | None, blocks: tuple[nn.Module, ...],
                 bandwidth: float | None, directory: str | None):
        self._step, self._budget, self._modules = step, budget, modules
        self._tier = DiskTier(directory)
        self._states = OptimizerStates(optimizer, self._tier) if optimizer is not None else None
        self._cache = CacheTiering(kv_cache, self._tier, budget) if kv_cache is not None else None
        self._blocks = {name: m for root in modules for name, m in root.named_modules()}  # by qualified name
        names = {id(m): name for name, m in self._blocks.items()}
        # the blocks the planner may recompute, by name, in model order
        self._candidates = tuple(names[id(b)] for b in blocks if not is_recomputed(b))
        self._recomputed: tuple[str, ...] = ()
        self._trying: tuple[str, ...] = ()  # blocks recomputed since the last recording: checked by the next
        self._over_before = 0  # bytes over budget of the plan that chose them
        self._budget_bytes: int | None = None
        self._bandwidth = bandwidth
        self._plan: OffloadPlan | None = None
        self._stale = True  # the next call records
        # whether every rank records at the next call too (the first call, or after a choice all ranks
        # made): only then may the recording decide recompute, since deciding takes a collective
        self._lockstep = True
        self.last_run: RunStats | CacheRun | None = None
        weakref.finalize(self, self._tier.close)

    def __call__(self, *args, **kwargs):
        if self._cache is not None:
            result = self._cache.run(self._step, args, kwargs)
            self.last_run = self._cache.last_run
            return result
        if self._stale:
            candidates = tuple(self._blocks[name] for name in self._candidates)
            result, recording = record(self._step, args, kwargs, self._modules, candidates)
            self._plan = self._make_plan(recording)
            return result
        run = _Run(self._plan, self._tier, self._states.prefetch if self._states else None)
        with torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
            result = self._step(*args, **kwargs)
        self.last_run = run.stats(self._states.last_moved if self._states is not None else 0)
        if run.mismatched:  # the step saved something else: record it again next call, with its own budget
            self._stale, self._budget_bytes, self._lockstep = True, None, False  # this rank alone
        return result

    @property
    def settled(self) -> bool:
        """Whether the next call runs the plan (False: it records, as the first does, and one after a
        recompute choice, a back-out, or a call that saved something else)."""
        return not self._stale

    def restore_optimizer_states(self) -> None:
        """The optimizer's states back on the device, as before a checkpoint is saved (the next
        update puts them away again)."""
        if self._states is not None:
            self._states.bring_back()

    def plan(self, *args, **kwargs) -> OffloadPlan:
        """The plan; given arguments and none is made yet, one call of the step (a real one) makes it."""
        if self._cache is not None:
            raise OffloadError("hp.offload: a decoding step's cache is placed layer by layer as it runs, with no "
                               "plan ahead; see last_run")
        if self._stale and self._plan is None:
            if not args and not kwargs:
                raise OffloadError("hp.offload: no plan yet; call the step once, or pass its arguments to plan()")
            self(*args, **kwargs)
        return self._plan

    @staticmethod
    def _on_any_rank(flags: list[bool]) -> list[bool]:
        """Each flag true where it is on any rank: a recompute replays its block's collectives, so every
        rank must recompute the same blocks (their timings, and so their choices, may differ)."""
        if not flags or not dist.is_initialized() or dist.get_world_size() == 1:
            return flags
        agreed = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # on CPU: every backend hp sets up has gloo for it
        return [bool(f) for f in agreed.tolist()]

    def _make_plan(self, recording: Recording) -> OffloadPlan:
        if self._bandwidth is None:
            self._bandwidth = self._tier.bandwidth()
        if self._budget_bytes is None:  # a fraction is of the peak before any block is recomputed
            budget = self._budget
            self._budget_bytes = int(budget * recording.step_peak_bytes) if isinstance(budget, float) else budget
        plan = plan_offload(recording, self._budget_bytes, self._tier.name, self._bandwidth, self._recomputed)
        lockstep, self._lockstep = self._lockstep, False
        if not lockstep:  # recorded on this rank alone: the blocks stay as all ranks chose them
            self._stale = False
            return plan
        if self._trying and self._on_any_rank([plan.over_budget_bytes > self._over_before])[0]:
            # recomputing them holds more at once than the estimate said: keep their activations again
            for name in self._trying:
                keep_activations(self._blocks[name])
            self._recomputed = tuple(n for n in self._recomputed if n not in self._trying)
            self._trying, self._stale, self._lockstep = (), True, True
            return plan
        picked = choose_recompute(recording, plan, self._tier.copy_share)
        agreed = self._on_any_rank([name in picked for name in self._candidates])
        chosen = tuple(name for name, f in zip(self._candidates, agreed) if f)
        self._stale, self._trying, self._over_before = bool(chosen), chosen, plan.over_budget_bytes
        self._lockstep = bool(chosen)
        if chosen:  # what a recomputed block saves changes: the next call records again
            for name in chosen:
                recompute(self._blocks[name])
            self._recomputed = tuple(n for n in self._blocks if n in chosen or n in self._recomputed)  # model order
            self._candidates = tuple(n for n in self._candidates if n not in chosen)
            plan = dataclasses.replace(plan, recompute=self._recomputed)
        return plan


@dataclass(frozen=True)
class RunStats:
    """What one planned call did: activation bytes resident at most (hp's ledger), bytes moved."""

    peak_resident_bytes: int
    bytes_offloaded: int
    bytes_read_back: int
    optimizer_bytes: int = 0  # optimizer states put away after the latest update (read back before the next)

    @property
    def bytes_moved(self) -> int:
        """Every byte that crossed to the slow tier and back: activations, and the states both ways."""
        return self.bytes_offloaded + self.bytes_read_back + 2 * self.optimizer_bytes


class _Saved:
    """One save's handle: the tensor kept, or how to rebuild it from the tier."""

    __slots__ = ("tensor", "key", "offset", "shape", "stride", "dtype", "spec", "index", "__weakref__")


class _Run:
    """The saved-tensor hooks of one planned call, with their resident-bytes ledger."""

    def __init__(self, plan: OffloadPlan, tier: DiskTier, on_backward: Callable[[], None] | None) -> None:
        self.tier, self.on_backward = tier, on_backward
        self.offload = {d.tensor.index: d.prefetch_at for d in plan.decisions if d.action == "offload"}
        self.by_event: dict[int, list[int]] = {}
        for index, event in self.offload.items():
            self.by_event.setdefault(event, []).append(index)
        self.recorded = [d.tensor for d in plan.decisions]
        self.storages: dict[tuple, int] = {}  # live storage -> recorded index
        self.saved = 0  # storages saved so far in this call
        self.keys: dict[int, int] = {}  # recorded index -> tier key
        self.fetched: dict[int, torch.UntypedStorage] = {}
        self.event = -1
        self.mismatched = False
        self.resident = self.peak = self.moved_out = self.moved_in = 0
        self.refs: dict[int, int] = {}  # recorded index -> handles autograd still holds
        self.on_device: dict[int, int] = {}  # recorded index -> its activation bytes now on the device

    def _tick(self) -> None:
        self.event += 1
        for index in self.by_event.get(self.event, ()):
            if index in self.keys:
                self.tier.prefetch(self.keys[index])

    def pack(self, t: torch.Tensor) -> _Saved:
        key = storage_key(t)
        index = self.storages.get(key)
        if index is None:
            self._tick()
            index, self.saved = self.saved, self.saved + 1
            self.storages[key] = index
            # an offloaded storage is held by nobody here: once freed, its key may name another
            weakref.finalize(local_of(t).untyped_storage(), self._forget, key, index)
            if not self._matches(index, t):
                self.mismatched = True
        handle = _Saved()
        handle.index = index
        local = local_of(t)
        if index in self.offload and not self.mismatched and not isinstance(local, LocalTensor):
            if index not in self.keys:
                self.keys[index] = self.tier.put(local.untyped_storage())
                self.moved_out += local.untyped_storage().nbytes()
            handle.tensor = None
            handle.key = self.keys[index]
            handle.offset, handle.shape, handle.stride = local.storage_offset(), local.shape, local.stride()
            handle.dtype = local.dtype
            handle.spec = t._spec if isinstance(t, DTensor) else None
        else:
            handle.tensor = t
            self._on_device(index, local.untyped_storage().nbytes())
        self.refs[index] = self.refs.get(index, 0) + 1
        weakref.finalize(handle, self._release, index)
        return handle

    def unpack(self, handle: _Saved) -> torch.Tensor:
        if self.on_backward is not None:  # backward begins: the optimizer's states come back meanwhile
            self.on_backward()
            self.on_backward = None
        self._tick()
        if handle.tensor is not None:
            return handle.tensor
        storage = self.fetched.get(handle.index)
        if storage is None:  # read once; every view of the storage shares it until the last is freed
            storage = self.fetched[handle.index] = self.tier.take(handle.key)
            self.moved_in += storage.nbytes()
            self._on_device(handle.index, storage.nbytes())
        local = torch.empty(0, dtype=handle.dtype, device=storage.device).set_(storage, handle.offset, handle.shape,
                                                                                handle.stride)
        return local if handle.spec is None else new_dtensor(local, handle.spec, requires_grad=False)

    def _matches(self, index: int, t: torch.Tensor) -> bool:
        if index >= len(self.recorded):
            return False
        want = self.recorded[index]
        return want.shape == tuple(t.shape) and want.dtype == t.dtype

    def _on_device(self, index: int, nbytes: int) -> None:
        if index in self.on_device or index >= len(self.recorded) or self.recorded[index].kind != "activation":
            return
        self.on_device[index] = nbytes
        self.resident += nbytes
        self.peak = max(self.peak, self.resident)

    def _release(self, index: int) -> None:
        """Autograd freed a handle: the storage leaves the ledger with its last handle."""
        self.refs[index] -= 1
        if self.refs[index] == 0:
            self.resident -= self.on_device.pop(index, 0)
            self.fetched.pop(index, None)

    def _forget(self, key: tuple, index: int) -> None:
        if self.storages.get(key) == index:
            del self.storages[key]

    def stats(self, optimizer_bytes: int) -> RunStats:
        return RunStats(self.peak, self.moved_out, self.moved_in, optimizer_bytes)

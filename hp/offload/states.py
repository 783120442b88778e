"""Optimizer states off the device between their updates, for `hp.offload(..., optimizer=...)`.

AdamW keeps two tensors per parameter that only its `step()` reads, so they
can wait in the slow tier for the whole forward and backward. After each
update (a post-hook on `optimizer.step()`, wherever the caller runs it) each
state tensor's bytes go to the tier and its storage shrinks to nothing (the
tensor object, its shape and the optimizer's references stay, as FSDP frees
gathered parameters); backward starts their reads, and a pre-hook on
`optimizer.step()` puts each storage back at its size with its bytes before
the update. The values are the same bytes, so the update is bit-identical.
Scalars (the step counts) stay: moving them costs more than they hold.
A DTensor state moves its local block.
"""

from __future__ import annotations

import torch
from torch.distributed._local_tensor import LocalTensor

from hp.offload.tiers import DiskTier
from hp.offload.use_def import local_of

_SMALLEST = 1024  # bytes: smaller states stay where they are


class OptimizerStates:
    """The states of `optimizer`, put away in `tier` between steps.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(512))
    >>> opt = torch.optim.AdamW([w])
    >>> w.grad = torch.ones(512); opt.step()
    >>> states = OptimizerStates(opt, DiskTier())
    >>> states.put_away(), opt.state[w]["exp_avg"].untyped_storage().nbytes()
    (4096, 0)
    >>> states.prefetch(); w.grad = torch.ones(512); opt.step()  # back for the update, away after it
    >>> states.last_moved, opt.state[w]["exp_avg"].untyped_storage().nbytes()
    (4096, 0)
    >>> states.bring_back(); opt.state[w]["exp_avg"].untyped_storage().nbytes()  # as before a checkpoint
    2048
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tier: DiskTier) -> None:
        self.optimizer, self.tier = optimizer, tier
        self._away: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, bytes, tier key)
        self.last_moved = 0  # bytes put away after the latest update
        self._hooks = (optimizer.register_step_pre_hook(lambda *args: self.bring_back()),
                       optimizer.register_step_post_hook(lambda *args: self.put_away()))

    def _storages(self) -> list[torch.UntypedStorage]:
        found: dict[int, torch.UntypedStorage] = {}
        for state in self.optimizer.state.values():
            for value in state.values():
                if not isinstance(value, torch.Tensor):
                    continue
                local = local_of(value)
                if isinstance(local, LocalTensor) or local.untyped_storage().nbytes() < _SMALLEST:
                    continue
                found.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage())
        return list(found.values())

    def put_away(self) -> int:
        """Move every state's bytes to the tier and free them here; the bytes moved."""
        moved = 0
        for storage in self._storages():
            nbytes = storage.nbytes()
            self._away.append((storage, nbytes, self.tier.put(storage)))
            moved += nbytes
        # the tier copies on its own thread: a storage is freed once its bytes are out
        for storage, _, key in self._away:
            self.tier.wait_written(key)
            storage.resize_(0)
        self.last_moved = moved or self.last_moved
        return moved

    def prefetch(self) -> None:
        """Start reading the states back (backward has begun: the update comes next)."""
        for _, _, key in self._away:
            self.tier.prefetch(key)

    def bring_back(self) -> None:
        """Every state back at its size with its bytes (the step's pre-hook)."""
        for storage, nbytes, key in self._away:
            data = self.tier.take(key)
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage).copy_(torch.empty(0, dtype=torch.uint8).set_(data))
        self._away.clear()

    def remove(self) -> None:
        self.bring_back()
        for hook in self._hooks:
            hook.remove()

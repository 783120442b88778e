"""A simulated tensor's metadata answered at once, where torch's `LocalTensor` spends most of `hp.simulated`'s time.

`LocalTensor` (one tensor holding each simulated rank's own) runs an op rank
by rank: per rank, it restores the rank's RNG state, rebuilds the arguments
from a flattened tree, runs the op and saves the state again, then combines
the results. A query of the tensor's metadata (strides, storage offset,
sizes, element count, contiguity) takes the same road, and every view op
makes several: after a view, torch has the result share its input's storage
(`return_and_correct_aliasing`), which reads the result's strides, sizes and
offset from outside the mode, so each read enters a `LocalTensorMode` of its
own first (the ranks' RNG states cloned, the random functions patched). Views
(view, t, transpose, slice, detach, expand...) are a third of a model's ops,
and those reads cost more than the views: a tiny model's sharded step under
`hp.simulated` ran in two thirds of the time with them answered directly.

`install()` answers them from the ranks' tensors, combined as torch combines
any per-rank results (`_combine_rank_results`: one int where every rank
agrees, else a symbolic int holding each rank's), so every answer is the one
torch's whole dispatch gives (`tests/test_simulated_metadata.py` compares
them on drawn tensors); sizes are the tensor's own, as `LocalTensorMode`
itself answers them. Every other op takes torch's own road. Where torch lacks
what this relies on (`_combine_rank_results`, a class-level dispatch), nothing
is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import _local_tensor as local
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

_aten = torch.ops.aten
# a tensor's metadata, no data read: each rank's answer, combined
QUERIES = frozenset({_aten.sym_stride.default, _aten.sym_storage_offset.default, _aten.sym_numel.default,
                     _aten.is_contiguous.default, _aten.is_contiguous.memory_format})
_MISS = object()
ORIGINAL: dict[str, Any] = {}  # torch's own dispatch, kept for comparison


def install() -> None:
    """Answer metadata queries of `LocalTensor`s directly (idempotent).

    >>> install(); install()
    >>> import torch
    >>> t = LocalTensor({0: torch.zeros(2, 3), 1: torch.zeros(4, 3)})
    >>> t.stride(0) == 3, t.t().stride(), t[1:].storage_offset()
    (True, (1, 3), 3)
    """
    own = LocalTensor.__dict__.get("__torch_dispatch__")
    if ORIGINAL or not hasattr(local, "_combine_rank_results") or not isinstance(own, classmethod):
        return
    ORIGINAL["tensor"] = own.__func__
    ORIGINAL["mode"] = LocalTensorMode.__torch_dispatch__
    LocalTensor.__torch_dispatch__ = classmethod(torch._disable_dynamo(_tensor_dispatch))
    LocalTensorMode.__torch_dispatch__ = _mode_dispatch


def answered(func, args: tuple, kwargs: dict | None) -> Any:
    """`func(*args, **kwargs)`'s value if it is a metadata query of one `LocalTensor`, else `_MISS`."""
    if kwargs or not args or not isinstance(args[0], LocalTensor):
        return _MISS
    if func is _aten.sym_size.default:
        return tuple(args[0]._size) if hasattr(args[0], "_size") else _MISS
    if func not in QUERIES or any(isinstance(a, torch.Tensor) for a in args[1:]):
        return _MISS
    ranks = {rank: func(t, *args[1:]) for rank, t in args[0]._local_tensors.items()}
    return local._combine_rank_results(ranks, None)


def _tensor_dispatch(cls, func, types, args=(), kwargs=None):
    value = answered(func, args, kwargs)
    return ORIGINAL["tensor"](cls, func, types, args, kwargs) if value is _MISS else value


def _mode_dispatch(self, func, types, args=(), kwargs=None):
    value = answered(func, args, kwargs)
    return ORIGINAL["mode"](self, func, types, args, kwargs) if value is _MISS else value

"""Two shortcuts through torch's `LocalTensor`, where `hp.simulated` spends most of its time: metadata, RNG.

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
torch's whole dispatch gives; sizes are the tensor's own, as `LocalTensorMode`
itself answers them. It also runs an op that draws no random numbers (one
not tagged `nondeterministic_seeded`; not in place, not a split) on each
rank without restoring and saving the rank's RNG state around it: the state
it would restore is the one it saved, untouched, and it picks each rank's
arguments by walking their tuples, lists and dicts directly rather than
through a pytree spec built per op. DTensor's own rank-local helpers (a
shard's size and offset, padding) take the same shortcut: sharding
propagation calls them for every strategy it prices, and under the mode
each call ran on every rank with the states around it, seven times what
the helper itself costs on 8 ranks. Every other op takes torch's own road.
`tests/test_simulated_metadata.py` compares every answer, value and random
draw with torch's own dispatch on drawn tensors. Where
torch lacks what this relies on (`supported()`), nothing is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload
from torch.distributed import _local_tensor as local
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.utils import _pytree as pytree

_aten = torch.ops.aten
# a tensor's metadata, no data read: each rank's answer, combined
QUERIES = frozenset({_aten.sym_stride.default, _aten.sym_storage_offset.default, _aten.sym_numel.default,
                     _aten.is_contiguous.default, _aten.is_contiguous.memory_format})
_MISS = object()
ORIGINAL: dict[str, Any] = {}  # torch's own dispatch and per-rank run, kept for comparison
_SEEDED = torch.Tag.nondeterministic_seeded
_OWN_RUN = frozenset({_aten.split.Tensor, _aten.hash_tensor.default})  # torch's run pads or special-cases them
_DTENSOR = "torch.distributed.tensor."
_RELIED_ON = ("_combine_rank_results", "_for_each_rank_run_func", "_map_to_rank_local_val", "_is_inplace_op",
              "return_and_correct_aliasing")


def supported() -> bool:
    """Whether this torch's `LocalTensor` has what the shortcuts rely on: its per-rank run and helpers, a
    class-level dispatch, and sizes kept on the tensor.

    >>> supported()
    True
    """
    return (all(hasattr(local, name) for name in _RELIED_ON) and hasattr(LocalTensor, "_size")
            and isinstance(LocalTensor.__dict__.get("__torch_dispatch__"), classmethod))


def install() -> None:
    """Answer metadata queries of `LocalTensor`s directly, and run ops that draw no random numbers without the
    ranks' RNG states around them (idempotent; nothing where `supported()` is false).

    >>> install(); install()
    >>> import torch
    >>> t = LocalTensor({0: torch.zeros(2, 3), 1: torch.zeros(4, 3)})
    >>> t.stride(0) == 3, t.t().stride(), t[1:].storage_offset()
    (True, (1, 3), 3)
    """
    if ORIGINAL or not supported():
        return
    ORIGINAL["tensor"] = LocalTensor.__dict__["__torch_dispatch__"].__func__
    ORIGINAL["mode"] = LocalTensorMode.__torch_dispatch__
    ORIGINAL["run"] = local._for_each_rank_run_func
    LocalTensor.__torch_dispatch__ = classmethod(torch._disable_dynamo(_tensor_dispatch))
    LocalTensorMode.__torch_dispatch__ = _mode_dispatch
    local._for_each_rank_run_func = _run_on_each_rank


def _answered(func, args: tuple, kwargs: dict | None) -> Any:
    """`func(*args, **kwargs)`'s value if it is a metadata query of one `LocalTensor`, else `_MISS`."""
    if kwargs or not args or not isinstance(args[0], LocalTensor):
        return _MISS
    if func is _aten.sym_size.default:
        return tuple(args[0]._size)
    if func not in QUERIES or any(isinstance(a, torch.Tensor) for a in args[1:]):
        return _MISS
    ranks = {rank: func(t, *args[1:]) for rank, t in args[0]._local_tensors.items()}
    return local._combine_rank_results(ranks, None)


def _tensor_dispatch(cls, func, types, args=(), kwargs=None):
    value = _answered(func, args, kwargs)
    return ORIGINAL["tensor"](cls, func, types, args, kwargs) if value is _MISS else value


def _mode_dispatch(self, func, types, args=(), kwargs=None):
    value = _answered(func, args, kwargs)
    return ORIGINAL["mode"](self, func, types, args, kwargs) if value is _MISS else value


def _plain(value) -> bool:
    """Whether `value` nests only tuples, lists and dicts (an op's arguments, nearly always): then `_at_rank`
    walks it as pytree would, without building a tree spec for every op."""
    kind = type(value)
    if kind is tuple or kind is list:
        return all(_plain(v) for v in value)
    if kind is dict:
        return all(_plain(v) for v in value.values())
    return kind not in pytree.SUPPORTED_NODES and not pytree.is_namedtuple_instance(value)


def _at_rank(value, rank: int):
    """`value` with each `LocalTensor` (or per-rank int) replaced by `rank`'s own, collectives in flight waited."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_at_rank(v, rank) for v in value)
    if kind is dict:
        return {k: _at_rank(v, rank) for k, v in value.items()}
    if isinstance(value, AsyncCollectiveTensor):
        value = value.wait()
    return local._map_to_rank_local_val(value, rank)


def _draws_nothing(func) -> bool:
    """Whether `func` is an op that draws no random numbers and torch's run would not special-case, or one of
    DTensor's rank-local helpers (shard sizes and offsets, padding: `maybe_run_for_local_tensor`, which torch
    requires to be free of side effects), which sharding propagation calls for every strategy it prices."""
    if isinstance(func, OpOverload):
        return func not in _OWN_RUN and _SEEDED not in func.tags and not local._is_inplace_op(func)
    return getattr(func, "__module__", "").startswith(_DTENSOR)


def _run_on_each_rank(func, ranks, args, kwargs, *, alias: bool = True) -> Any:
    """torch's run of `func` on each rank's tensors (`_for_each_rank_run_func`), without the RNG state set and
    saved around each rank's call where `func` draws no random numbers; other ops take torch's own run."""
    if not _draws_nothing(func) or not _plain((args, kwargs)):
        return ORIGINAL["run"](func, ranks, args, kwargs, alias=alias)
    results = {}
    for rank in sorted(ranks):
        results[rank] = func(*_at_rank(args, rank), **(_at_rank(kwargs, rank) if kwargs else {}))
    combined = local._combine_rank_results(results, None)
    return local.return_and_correct_aliasing(func, args, kwargs, combined) if alias else combined

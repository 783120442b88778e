"""hp's shortcuts in simulation (`hp.compat.local_tensor`) give what torch's own `LocalTensor` dispatch gives.

Hypothesis draws each simulated rank's tensor (uneven shapes too, so that
some answers are per-rank symbolic ints) and a chain of views, arithmetic and
random draws over it; every step's metadata and each rank's values are
computed twice, once with hp's shortcuts and once with torch's own dispatch
and per-rank run restored (the same seed each time), and compared.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import _local_tensor as local
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

import hp  # noqa: F401  installs the shortcut
from hp.compat import local_tensor

aten = torch.ops.aten


@contextmanager
def torch_own():
    """torch's own `LocalTensor` dispatch, for the block."""
    patched = LocalTensor.__dict__["__torch_dispatch__"], LocalTensorMode.__torch_dispatch__, local._for_each_rank_run_func
    LocalTensor.__torch_dispatch__ = classmethod(local_tensor.ORIGINAL["tensor"])
    LocalTensorMode.__torch_dispatch__ = local_tensor.ORIGINAL["mode"]
    local._for_each_rank_run_func = local_tensor.ORIGINAL["run"]
    try:
        yield
    finally:
        LocalTensor.__torch_dispatch__, LocalTensorMode.__torch_dispatch__, local._for_each_rank_run_func = patched


def plain(value):
    """An answer as plain data: a per-rank symbolic int as {rank: int}."""
    if isinstance(value, (tuple, list)):
        return tuple(plain(v) for v in value)
    if isinstance(value, torch.SymInt):
        return dict(value.node._local_ints)
    return value


@st.composite
def local_tensors(draw):
    world = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    base = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    uneven = draw(st.sampled_from([None, *range(ndim)]))  # this dim's size differs from rank to rank
    shapes = {r: [draw(st.integers(1, 5)) if d == uneven else n for d, n in enumerate(base)] for r in range(world)}
    return LocalTensor({r: torch.randn(*shape) for r, shape in shapes.items()})


VIEWS = {
    "t": lambda t: t.transpose(0, -1),
    "slice": lambda t: t[1:] if min(b.shape[0] for b in t._local_tensors.values()) > 1 else t,
    "unsqueeze": lambda t: t.unsqueeze(0),
    "flatten": lambda t: t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1),
    "expand": lambda t: t.unsqueeze(0).expand(2, *t.shape),
    "detach": lambda t: t.detach(),
    "select": lambda t: t.select(0, 0) if t.dim() > 1 else t,
    # ops that compute, and random draws between them: each rank's stream goes on where it was
    "add": lambda t: t * 2 + 1,
    "sum": lambda t: t.sum(-1, keepdim=True),
    "rand": lambda t: t + torch.rand_like(t),
    "dropout": lambda t: torch.nn.functional.dropout(t, 0.5),
}


def queries(t: LocalTensor) -> dict:
    return {str(q): plain(q(t)) for q in local_tensor.QUERIES if q is not aten.is_contiguous.memory_format} | {
        "sizes": plain(aten.sym_size.default(t)),
        "channels_last": plain(aten.is_contiguous.memory_format(t, torch.channels_last)) if t.dim() == 4 else None}


@given(local_tensors(), st.lists(st.sampled_from(sorted(VIEWS)), max_size=4), st.booleans())
def test_metadata_values_and_draws_equal_torchs_own_dispatch(t, chain, in_mode):
    if not local_tensor.supported():
        pytest.skip("this torch's LocalTensor lacks what hp's shortcuts rely on: none is installed")
    assert local_tensor.ORIGINAL, "hp did not install its LocalTensor shortcut"

    def walk():
        torch.manual_seed(0)
        with LocalTensorMode(frozenset(t._ranks)) if in_mode else nullcontext():
            steps, x = [queries(t)], t
            for name in chain:
                x = VIEWS[name](x)
                steps.append(queries(x) | {"values": {r: v.tolist() for r, v in x._local_tensors.items()}})
            return steps

    fast = walk()
    with torch_own():
        own = walk()
    assert fast == own


@given(st.integers(1, 4), st.integers(0, 9), st.integers(1, 4))
def test_dtensor_s_rank_local_helpers_answer_as_torchs_own_run_and_leave_the_draws_alone(world, size, chunks):
    """A shard's size and offset on each simulated rank (what sharding propagation asks for every strategy it
    prices), then a random draw: the same with hp's shortcut as with torch's own per-rank run."""
    from torch.distributed._local_tensor import LocalIntNode
    from torch.distributed.tensor.placement_types import Shard

    def walk():
        torch.manual_seed(0)
        with LocalTensorMode(world):
            rank = torch.SymInt(LocalIntNode({r: r for r in range(world)}))
            sizes = plain(Shard.local_shard_size_and_offset(size, chunks, rank))
            draw = torch.rand(3)
            return sizes, {r: v.tolist() for r, v in draw._local_tensors.items()}

    fast = walk()
    with torch_own():
        own = walk()
    assert fast == own

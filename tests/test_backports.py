"""What hp backports to older torch releases, checked on this one by forcing the older path."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._ops import _view_ops
from torch.distributed.tensor.placement_types import _StridedShard

import hp
from hp.compat import backports
from hp.ops import flatten, selection

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def undecodable_strided_shards(monkeypatch):
    """The older planner, which raises on a strided shard that encodes no shard order, behind the backport."""

    def planner_of_2_11(src_spec, dst_spec, use_graph_based_transform=None):
        if any(isinstance(p, _StridedShard) for p in (*src_spec.placements, *dst_spec.placements)):
            raise ValueError(f"placements {src_spec.placements} cannot be interpreted into a shard_order")
        return planned(src_spec, dst_spec, use_graph_based_transform)

    planned = _redistribute._gen_transform_infos_non_cached
    monkeypatch.setattr(_redistribute, "_gen_transform_infos_non_cached", backports._greedy_when_undecodable(planner_of_2_11))
    _redistribute._gen_transform_infos.cache_clear()
    yield
    _redistribute._gen_transform_infos.cache_clear()


PLACEMENTS = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=3), _StridedShard(1, split_factor=2)]


@pytest.mark.parametrize("src", PLACEMENTS, ids=str)
@pytest.mark.parametrize("dst", PLACEMENTS, ids=str)
def test_strided_shards_redistribute_by_the_backported_plan(undecodable_strided_shards, src, dst):
    mesh = hp.mesh(tp=2, simulate=True)
    whole = torch.arange(48.0).reshape(12, 4)
    with hp.simulated(mesh):
        start = DTensor.from_local(whole, mesh, [Replicate()]).redistribute(mesh, [src])
        moved = start.redistribute(mesh, [dst])
        assert moved.placements == (dst,)
        torch.testing.assert_close(moved.full_tensor(), whole, rtol=0, atol=0)


@pytest.fixture
def backported_transpose(monkeypatch):
    """aten.t under the backported rule, whatever torch's own is."""
    propagator, calls = DTensor._op_dispatcher.sharding_propagator, []

    def rule(op_schema):
        calls.append(op_schema)
        return backports._transpose_strategy(op_schema)

    if torch.ops.aten.t.default in getattr(propagator, "op_single_dim_strategy_funcs", {}):
        pytest.skip("this torch states aten.t by a single-dim rule, which moves strided shards")
    monkeypatch.setitem(propagator.op_strategy_funcs, torch.ops.aten.t.default, rule)
    propagator.propagate_op_sharding.cache_clear()
    yield calls
    propagator.propagate_op_sharding.cache_clear()


@pytest.mark.parametrize("placements", [(Shard(0), _StridedShard(0, split_factor=2)), (_StridedShard(1, split_factor=3), Replicate()),
                                        (Shard(1), Shard(0)), (Replicate(), Replicate())], ids=str)
def test_a_transposed_split_moves_to_the_other_dim(backported_transpose, placements):
    mesh = hp.mesh(ep=2, cp=2, simulate=True)
    whole = torch.arange(24.0 * 12).reshape(24, 12)
    with hp.simulated(mesh):
        moved = DTensor.from_local(whole, mesh, [Replicate()] * 2).redistribute(mesh, placements).t()
        assert moved.placements == tuple(backports._other_dim(p) for p in placements)
        torch.testing.assert_close(moved.full_tensor(), whole.t(), rtol=0, atol=0)
    assert backported_transpose, "the backported rule laid the transpose out"


@pytest.fixture
def views_refusing_split_flattens(monkeypatch):
    """DTensor's view rule as torch 2.11 has it (a flatten whose later dim is split refused), behind the backport."""
    own = _view_ops.propagate_shape_and_sharding

    def as_on_2_11(placements, shape, rule, mesh_shape, strict_view=False):
        group = backports._flattened_group(rule, len(shape))
        if group is not None and any(isinstance(p, Shard) and group[1] < p.dim < sum(group) for p in placements):
            raise RuntimeError("Attempted to flatten multiple dimensions, with dimension 1 being sharded.")
        return own(placements, shape, rule, mesh_shape, strict_view)

    monkeypatch.setattr(_view_ops, "propagate_shape_and_sharding", backports._flattening_split_leading_dims(as_on_2_11))
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    yield
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([(2, 4, 3), (4, 2, 6), (2, 2, 2, 5)]),
       st.lists(st.sampled_from(["r", 0, 1, 2]), min_size=2, max_size=2))
def test_views_flatten_leading_dims_a_later_one_split_and_back(views_refusing_split_flattens, shape, splits):
    """`aten.view` as a decomposition calls it: `b s/cp h` to `(b s) h` and back, each rank viewing its block."""
    mesh = hp.mesh(dp=2, cp=2, simulate=True)
    placements = [Replicate() if d == "r" else Shard(d % (len(shape) - 1)) for d in splits]
    whole = torch.arange(float(math.prod(shape))).reshape(shape)
    flat_shape = [shape[0] * shape[1], *shape[2:]]
    assume(all(shape[p.dim] % 2 ** placements.count(p) == 0 for p in placements if isinstance(p, Shard)))
    later_split = any(isinstance(p, Shard) and p.dim == 1 for p in placements)
    assume(not later_split or flatten.flattened_placements(shape, placements, mesh.shape, 2) is not None)
    with hp.simulated(mesh):
        x = DTensor.from_local(whole, mesh, [Replicate()] * 2).redistribute(mesh, placements)
        flat = torch.ops.aten.view.default(x, flat_shape)
        torch.testing.assert_close(flat.full_tensor(), whole.reshape(flat_shape), rtol=0, atol=0)
        back = torch.ops.aten.view.default(flat * 2, list(shape))
        torch.testing.assert_close(back.full_tensor(), 2 * whole, rtol=0, atol=0)
    if later_split:  # the backport's layout: each rank viewed its block
        assert list(flat.placements) == flatten.flattened_placements(shape, placements, mesh.shape, 2)


@pytest.mark.parametrize("tokens", [Replicate(), Shard(0)], ids=str)
def test_a_fused_dim_views_as_its_parts_and_back(views_refusing_split_flattens, tokens):
    """A vision tower's `[q k v]/tp` output viewed as (3, heads/tp, d) and, as its backward does, flattened back."""
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    whole = torch.arange(4.0 * 3 * 4 * 2).reshape(4, 24)
    with hp.simulated(mesh):
        qkv = DTensor.from_local(whole, mesh, [Replicate()] * 2).redistribute(mesh, [tokens, _StridedShard(1, split_factor=3)])
        heads = torch.ops.aten.view.default(qkv, [4, 3, 4, 2])
        assert heads.placements == (tokens, Shard(2))
        torch.testing.assert_close(heads.full_tensor(), whole.view(4, 3, 4, 2), rtol=0, atol=0)
        back = torch.ops.aten._unsafe_view.default(heads * 2, [4, 24])
        assert back.placements == (tokens, _StridedShard(1, split_factor=3))
        torch.testing.assert_close(back.full_tensor(), 2 * whole, rtol=0, atol=0)


@given(
    st.sampled_from(["topk", "sort", "max", "min"]), st.sampled_from(["b/tp e", "b e/tp", "a b/tp e"]), st.booleans(),
    st.integers(1, 3), st.integers(2, 5),
)
def test_selections_gather_the_ops_values_and_gradients(name, layout, keepdim, per_rank, experts):
    """hp's form of top-k, sort, max and min (values gathered at the indices) equals the op itself."""
    mesh = hp.mesh(tp=2, simulate=True)
    x = torch.randn(4 * per_rank, 2 * experts)
    calls = {"topk": lambda f, t: f(t, 2, -1), "sort": lambda f, t: f(t, -1), "max": lambda f, t: f(t, 1, keepdim),
             "min": lambda f, t: f(t, 1, keepdim)}
    op = getattr(torch, name)
    kernel = selection.kernels(needed=True)[op]
    want_x = x.clone().requires_grad_()
    want = calls[name](op, want_x)
    weights = torch.randn(want.values.shape)
    (want.values * weights).sum().backward()
    with hp.simulated(mesh), hp.region():
        leaf = hp.shard(x.view(2, -1, x.shape[-1]) if layout.startswith("a") else x, layout, mesh).requires_grad_()
        got_x = leaf.view(x.shape)  # "a b/tp e" flattened: rows split strided, as the tokens of `b s/cp`
        got = calls[name](kernel, got_x)
        if got is NotImplemented:  # the op's own, where the selected dim is split
            assert layout == "b e/tp"
            return
        assert type(got) is type(want)
        (got.values * weights).sum().backward()
        torch.testing.assert_close(got.values.full_tensor(), want.values, rtol=0, atol=0)
        torch.testing.assert_close(got.indices.full_tensor(), want.indices, rtol=0, atol=0)
        torch.testing.assert_close(leaf.grad.full_tensor().view(x.shape), want_x.grad, rtol=0, atol=0)


def test_backports_apply_exactly_where_torch_lacks_the_fix():
    from torch.distributed.tensor import _dtensor_spec

    assert backports._redistribute_patched() != hasattr(_dtensor_spec, "_StridedShardNotDecodableError")
    assert bool(selection.kernels()) == (backports.torch_version() < (2, 13))
    registered = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs.get(torch.ops.aten.t.default)
    assert (registered is backports._transpose_strategy) == backports.transpose_leaves_strided_shards()


_UNTRACEABLE_ON_2_11 = re.compile(r"type\([^()]*(?:\([^()]*\))?[^()]*\) is (?:not )?(?:Shard|_StridedShard|Replicate|Partial)\b"
                                  r"|\.indices\(")


def test_hp_avoids_what_dynamo_cannot_trace_on_torch_2_11():
    """Compiled blocks trace hp's kernels; 2.11's dynamo reads `type(placement) is Shard` as false and
    cannot trace `slice.indices` (the rest of the list in hp/backports.py is checked by running)."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "hp").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if _UNTRACEABLE_ON_2_11.search(re.sub(r"`[^`]*`", "", line))]  # code quoted in prose is not code
    assert not found, "\n".join(found)

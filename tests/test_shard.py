"""hp.shard / constrain / from_local on simulated meshes: values, blocks per rank, gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import expected_block, local_blocks, mesh_axes, placed_layout, simulate
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import hp
from hp.layouts import Layout, to_placements


def _check_blocks(x, t, layout, mesh):
    blocks = local_blocks(x)
    for rank in range(mesh.size()):
        want = expected_block(t, layout, mesh, rank)
        assert torch.equal(blocks[rank], want), f"rank {rank} holds the wrong block of {layout}"


@given(st.data())
def test_shard_puts_each_block_on_its_rank(data):
    axes = data.draw(mesh_axes())
    layout, shape = data.draw(placed_layout(axes))
    t = torch.randn(shape)
    with simulate(axes) as mesh:
        x = hp.shard(t, layout, mesh)
        _check_blocks(x, t, layout, mesh)
        assert torch.equal(x.full_tensor(), t)
        assert hp.layout_of(x) == layout


@given(st.data())
def test_constrain_moves_values_between_any_two_layouts(data):
    axes = data.draw(mesh_axes())
    src, shape = data.draw(placed_layout(axes))
    dst, _ = data.draw(placed_layout(axes, shape=shape))
    shape = tuple(math.lcm(s, _shards(axes, d)) for s, d in zip(shape, dst.dims))
    t = torch.randn(shape)
    with simulate(axes) as mesh:
        y = hp.constrain(hp.shard(t, src, mesh), dst)
        assert tuple(y.placements) == to_placements(dst, mesh)
        _check_blocks(y, t, dst, mesh)
        assert torch.allclose(y.full_tensor(), t, rtol=1e-6, atol=1e-6)


def _shards(axes, dim) -> int:
    sizes = dict(axes)
    return math.prod(sizes[a] for a in dim.axes)


@given(st.data())
def test_constrain_is_differentiable(data):
    axes = data.draw(mesh_axes())
    src, shape = data.draw(placed_layout(axes, allow_partial=False))
    dst, _ = data.draw(placed_layout(axes, shape=shape))
    _check_gradient(axes, src, dst, shape)


@given(st.data())
def test_resolving_pending_sums_is_differentiable(data):
    """From a pending sum to any layout without one: the gradient of the summed value, on every rank."""
    axes = data.draw(mesh_axes())
    src, shape = data.draw(placed_layout(axes))
    dst, _ = data.draw(placed_layout(axes, shape=shape, allow_partial=False))
    _check_gradient(axes, src, dst, shape)


def _check_gradient(axes, src: Layout, dst: Layout, shape) -> None:
    """`constrain` from src to dst: dst's placements, the values, and the gradient of a loss on them."""
    shape = tuple(math.lcm(s, _shards(axes, d)) for s, d in zip(shape, dst.dims))
    t, w = torch.randn(shape), torch.randn(shape)
    ref = t.clone().requires_grad_()
    (ref.sin() * w).sum().backward()
    with simulate(axes) as mesh:
        x = hp.shard(t, src, mesh).requires_grad_()
        y = hp.constrain(x, dst)
        assert tuple(y.placements) == to_placements(dst, mesh)
        (y.sin() * hp.shard(w, Layout(dst.dims), mesh)).sum().backward()
        torch.testing.assert_close(y.full_tensor(), t, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-6, atol=1e-6)


@given(st.data())
def test_from_local_assembles_what_shard_split(data):
    axes = data.draw(mesh_axes())
    layout, shape = data.draw(placed_layout(axes))
    t = torch.randn(shape)
    with simulate(axes) as mesh:
        pieces = LocalTensor({r: expected_block(t, layout, mesh, r) for r in range(mesh.size())})
        x = hp.from_local(pieces, layout, mesh)
        assert tuple(x.shape) == shape
        assert hp.layout_of(x) == layout
        assert torch.equal(x.full_tensor(), t)


@pytest.mark.parametrize("mesh_order", list(itertools.permutations("abc")))
def test_a_dim_split_over_axes_against_mesh_order_uses_strided_shards(mesh_order):
    sizes = {"a": 2, "b": 3, "c": 2}
    t = torch.arange(48.0).reshape(24, 2)
    with simulate([(n, sizes[n]) for n in mesh_order]) as mesh:
        for order in itertools.permutations("abc"):
            layout = hp.layout("h/" + "/".join(order) + " w")
            x = hp.shard(t, layout, mesh)
            _check_blocks(x, t, layout, mesh)
            assert hp.layout_of(x) == layout
            assert torch.equal(x.full_tensor(), t)


def test_strided_placements_for_the_docstring_case():
    with simulate([("y", 2), ("x", 4)]) as mesh:
        assert to_placements(hp.layout("h/x/y"), mesh) == (_StridedShard(0, split_factor=4), Shard(0))
        assert to_placements(hp.layout("h/y/x"), mesh) == (Shard(0), Shard(0))


def test_uneven_shards_follow_torch_chunk():
    t = torch.arange(7.0 * 3).reshape(7, 3)
    with simulate([("dp", 2), ("tp", 4)]) as mesh:
        layout = hp.layout("b/dp/tp h")
        with pytest.raises(hp.LayoutError, match="not divisible"):
            hp.shard(t, layout, mesh)
        x = hp.shard(t, layout, mesh, uneven=True)
        _check_blocks(x, t, layout, mesh)
        assert torch.equal(x.full_tensor(), t)
        y = hp.from_local(x.to_local(), layout, mesh, shape=(7, 3))
        assert torch.equal(y.full_tensor(), t)


def test_partial_layout_keeps_the_value_on_the_first_rank():
    t = torch.randn(4, 6)
    with simulate([("dp", 2), ("tp", 2)]) as mesh:
        x = hp.shard(t, "b h/dp +tp", mesh)
        assert isinstance(x.placements[1], Partial)
        blocks = local_blocks(x)
        assert torch.equal(blocks[0], t[:, :3]) and torch.equal(blocks[1], torch.zeros(4, 3))
        assert torch.equal(hp.constrain(x, "b h").full_tensor(), t)
        assert str(hp.layout_of(hp.constrain(x, "b/tp h/dp"))) == "b/tp h/dp"


def test_rules_bind_logical_names():
    t = torch.randn(4, 8, 6)
    with simulate([("dp", 2), ("tp", 2)]) as mesh:
        with hp.rules(batch="dp", heads="tp"):
            x = hp.shard(t, "batch seq heads", mesh)
        assert str(hp.layout_of(x)) == "batch/dp seq heads/tp"
        y = hp.constrain(x, "batch seq heads", rules={"seq": ("dp", "tp"), "batch": None})
        assert str(hp.layout_of(y)) == "batch seq/dp/tp heads"
        assert torch.equal(y.full_tensor(), t)


def test_describe_prints_names_sizes_axes_and_partials():
    with simulate([("dp", 2), ("cp", 2), ("tp", 2)]) as mesh:
        x = hp.shard(torch.zeros(8, 128, 512), "b/dp s/cp h +tp", mesh)
        assert hp.describe(x) == "f32[b=8/dp, s=128/cp, h=512] +tp"
        y = hp.shard(torch.zeros(4, 6, 8, dtype=torch.bfloat16), "... h/tp", mesh)
        assert hp.describe(y) == "bf16[4, 6, h=8/tp]"
        assert hp.describe(hp.constrain(y, "4 6/tp 8")) == "bf16[4, 6/tp, 8]"

"""Fused dims (`[q k v]/tp in`): notation, placements, the kernels, and Phi-3 against one device.

A fused dim of equal parts split over one axis is DTensor's `_StridedShard`;
the fused linear and the part slices run without communication, so a
Phi-3 layer moves what Megatron moves: two all-reduces in forward.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import expected_block, fused_dim, local_blocks, mesh_axes, placed_layout, simulate
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hp
from hp.cost import ring_bytes
from hp.layouts import from_placements, to_placements
from hp.layouts.types import Dim, Layout


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# -- notation -----------------------------------------------------------------


@given(st.data())
def test_fused_dims_print_then_parse_round_trip(data):
    pool = list(data.draw(st.permutations(["q", "k", "v", "gate", "up", "a", "b", "c", "d"])))
    dims = [data.draw(fused_dim(pool, axes)) for axes in (("tp",), ())]
    layout = Layout((*dims, Dim((pool.pop(),), ("dp",))), ("cp",) if data.draw(st.booleans()) else ())
    again = hp.layout(str(layout))
    assert again == layout and str(again) == str(layout) and hash(again) == hash(layout)


# (layout text, words of the message, the caret's span in the text)
BAD_SYNTAX = [
    ("[] in", "empty fused dimension '[]'", (0, 2)),
    ("[q [k v]]", "fused dimensions cannot nest", (3, 4)),
    ("[q ...]", "'...' cannot stand inside a fused dimension", (3, 6)),
    ("[q k v in", "'[' is never closed", (0, 1)),
    ("q k]", "unexpected character ']'", (3, 4)),
    ("] h", "']' without a matching '['", (0, 1)),
    ("[q/tp k] in", "split a fused dimension as a whole", (2, 3)),
    ("[q k q] in", "dimension name 'q' is used twice", (5, 6)),
    ("q [q k]", "dimension name 'q' is used twice", (3, 4)),
    ("[q:64 k v]", "give every part of a fused dimension a size, or none", (6, 7)),
    ("[q:0 k:1]", "sizes are positive", (1, 4)),
    ("[q:x k:1]", "expected a part size after ':'", (3, 4)),
    ("[q:-2 k:1]", "expected a part size after ':'", (3, 4)),
    ("[16:16 k:1]", "an anonymous part is its size", (1, 3)),
    ("[q,k]", "unexpected character ',' in a fused dimension", (2, 3)),
    ("[q (a b)]", "a fused part is a name or a size, not a composite", (3, 4)),
    ("([q k] d)", "a composite dimension cannot hold a fused one", (1, 2)),
    ("[q k]/tp/tp", "mesh axis 'tp' is used twice", (9, 11)),
]


@pytest.mark.parametrize("text, words, span", BAD_SYNTAX, ids=[c[0] for c in BAD_SYNTAX])
def test_malformed_fused_dims_name_the_problem_under_a_caret(text, words, span):
    with pytest.raises(hp.LayoutError, match=re.escape(words)) as err:
        hp.layout(text)
    assert (err.value.text, err.value.span) == (text, span)


# -- placements ---------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_equal_parts_over_one_axis_are_dtensors_strided_shard(parts, ranks):
    names = " ".join("qkvu"[:parts])
    t = torch.randn(parts * ranks * 2, 3)
    with simulate([("tp", ranks)]) as mesh:
        ours = hp.shard(t, f"[{names}]/tp in", mesh)
        # every rank splits its copy, as hp.shard does (a simulated scatter of strided shards
        # hands every rank rank 0's block)
        theirs = distribute_tensor(t, mesh, [_StridedShard(0, split_factor=parts)], src_data_rank=None)
        assert tuple(ours.placements) == ((_StridedShard(0, split_factor=parts),) if parts > 1 else (Shard(0),))
        definition = hp.layout(f"[{names}]/tp in")
        for rank, block in local_blocks(theirs).items():  # DTensor's own blocks are the notation's
            assert torch.equal(block, expected_block(t, definition, mesh, rank))
            assert torch.equal(local_blocks(ours)[rank], block)
        assert torch.equal(theirs.full_tensor(), t) and torch.equal(ours.full_tensor(), t)


def test_rank_r_holds_piece_r_of_every_part():
    t = torch.arange(12.0)
    with simulate([("tp", 2)]) as mesh:
        blocks = local_blocks(hp.shard(t, "[q k v]/tp", mesh))
    assert blocks[0].tolist() == [0, 1, 4, 5, 8, 9] and blocks[1].tolist() == [2, 3, 6, 7, 10, 11]


@given(st.data())
def test_fused_layouts_put_each_block_on_its_rank_and_read_back(data):
    axes = data.draw(mesh_axes())
    layout, shape = data.draw(placed_layout(axes, fused=True))
    t = torch.randn(shape)
    with simulate(axes) as mesh:
        x = hp.shard(t, layout, mesh)
        for rank, block in local_blocks(x).items():
            assert torch.equal(block, expected_block(t, layout, mesh, rank)), f"rank {rank}, {layout}"
        assert torch.equal(x.full_tensor(), t)
        assert hp.layout_of(x) == layout


def _two_layouts(data, allow_partial: bool):
    """Mesh axes, two fused-capable layouts of one shape on them, and the shape."""
    axes = data.draw(mesh_axes())
    src, shape = data.draw(placed_layout(axes, allow_partial=allow_partial, fused=True))
    # allow_partial False keeps both sides free of pending sums: a nonlinear op on one makes DTensor reduce-scatter
    # it, which LocalTensorMode cannot simulate over uneven chunks
    dst, _ = data.draw(placed_layout(axes, shape=shape, fused=True, allow_partial=allow_partial))
    sizes = dict(axes)

    def multiple(dim) -> int:  # what a dim's size must be a multiple of
        return len(dim.factors) ** dim.fused * math.prod(sizes[a] for a in dim.axes)

    return axes, src, dst, tuple(math.lcm(n, multiple(a), multiple(b)) for n, a, b in zip(shape, src.dims, dst.dims))


@given(st.data())
def test_constrain_moves_values_between_fused_layouts(data):
    axes, src, dst, shape = _two_layouts(data, allow_partial=True)
    t = torch.randn(shape)
    with simulate(axes) as mesh:
        y = hp.constrain(hp.shard(t, src, mesh), dst)
        for rank, block in local_blocks(y).items():
            assert torch.equal(block, expected_block(t, dst, mesh, rank)), f"rank {rank}, {src} -> {dst}"
        assert torch.allclose(y.full_tensor(), t)


@given(st.data())
def test_constrain_between_fused_layouts_is_differentiable(data):
    axes, src, dst, shape = _two_layouts(data, allow_partial=False)
    t, w = torch.randn(shape), torch.randn(shape)
    ref = t.clone().requires_grad_()
    (ref.sin() * w).sum().backward()
    with simulate(axes) as mesh:
        x = hp.shard(t, src, mesh).requires_grad_()
        (hp.constrain(x, dst).sin() * hp.shard(w, Layout(dst.dims), mesh)).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-6, atol=1e-6)


def _shard(shape, spec):
    return lambda mesh: hp.shard(torch.zeros(shape), spec, mesh)


BAD_ON_A_MESH = [
    ("unequal parts split", _shard((12, 4), "[q:8 k:2 v:2]/tp in"), "parts of unequal sizes (8 + 2 + 2) split over 'tp'"),
    ("unequal parts, what to do", _shard((12, 4), "[q:8 k:2 v:2]/tp in"), "lay the dimension out as equal parts, or keep it unsplit"),
    ("two axes", _shard((12, 4), "[q k v]/dp/tp in"), "split over 2 mesh axes"),
    ("sizes do not add up", _shard((12, 4), "[q:4 k:4 v:2] in"), "parts of sizes 4 + 4 + 2 = 10 but the tensor has 12"),
    ("no equal parts", _shard((10, 4), "[q k v] in"), "size 10, not divisible into its 3 equal parts"),
    ("part not divisible", _shard((6, 4), "[q k v]/tp in"), "each part of fused dimension 0 has size 2, not divisible by its 4 shards"),
    ("anonymous sizes", _shard((12, 4), "[4 4 2] in"), "parts of sizes 4 + 4 + 2 = 10"),
]


@pytest.mark.parametrize("what, call, words", BAD_ON_A_MESH, ids=[c[0] for c in BAD_ON_A_MESH])
def test_fused_dims_that_do_not_fit_are_refused_with_a_caret_at_the_dim(what, call, words):
    with simulate([("dp", 2), ("tp", 4)]) as mesh:
        with pytest.raises(hp.LayoutError, match=re.escape(words)) as err:
            call(mesh)
    assert err.value.span is not None and err.value.span[0] == 0


def test_a_split_fused_dim_beside_a_dim_split_against_mesh_order_is_refused():
    with simulate([("dp", 2), ("tp", 2), ("cp", 2)]) as mesh:
        with pytest.raises(hp.LayoutError, match="DTensor cannot gather the two strided shards") as err:
            hp.shard(torch.zeros(4, 4), "b/tp/dp [q k]/cp", mesh)
        assert err.value.text == "b/tp/dp [q k]/cp" and err.value.span == (8, 16)
        hp.shard(torch.zeros(4, 4), "b/dp/tp [q k]/cp", mesh)  # in mesh order: fine


def test_unsplit_fused_dims_may_have_unequal_parts():
    t = torch.randn(12, 4)
    with simulate([("tp", 2)]) as mesh:
        x = hp.shard(t, "[q:8 k:2 v:2] in/tp", mesh)
        assert hp.describe(x) == "f32[[q:8 k:2 v:2]=12, in=4/tp]" and torch.equal(x.full_tensor(), t)


def test_a_strided_shard_reads_back_as_fused_with_or_without_names():
    mesh = hp.mesh(dp=2, tp=2, simulate=True)
    placements = [Replicate(), _StridedShard(0, split_factor=3)]
    named = from_placements(placements, mesh, (12, 4), hp.layout("[q k v] in"))
    assert str(named) == "[q k v]/tp in"
    assert str(from_placements(placements, mesh, (12, 4))) == "[4 4 4]/tp 4"
    assert str(from_placements(placements, mesh, (12, 4), hp.layout("out in"))) == "[4 4 4]/tp in"
    assert str(from_placements([Replicate(), Shard(0)], mesh, (12, 4), hp.layout("[q k v] in"))) == "12/tp in"
    with simulate([("dp", 2), ("tp", 2)]):
        x = hp.from_local(torch.zeros(6, 4), "[q k v]/tp in/dp", mesh)
        assert hp.describe(x) == "f32[[q k v]=12/tp, in=8/dp]"
        assert tuple(x.placements) == to_placements(hp.layout("[q k v]/tp in/dp"), mesh)


def test_rules_bind_names_not_parts():
    with hp.rules(q="tp", h="dp"):
        assert str(hp.layouts.active_rules().apply(hp.layout("[q k] h"))) == "[q k] h/dp"


# -- kernels ------------------------------------------------------------------


@pytest.mark.parametrize(
    "axes, x_spec",
    [([("tp", 2)], "b s h"), ([("tp", 4)], "b s/tp h"), ([("dp", 2), ("tp", 2)], "b/dp s h")],
)
def test_fused_linear_is_column_parallel_per_part(axes, x_spec):
    torch.manual_seed(0)
    x, w, b, g = torch.randn(2, 8, 16), torch.randn(24, 16), torch.randn(24), torch.randn(2, 8, 24)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    (F.linear(*ref) * g).sum().backward()
    with simulate(axes) as mesh, hp.region():
        xs = hp.shard(x, x_spec, mesh).requires_grad_()
        ws = hp.shard(w, "[q k v]/tp in", mesh).requires_grad_()
        bs = hp.shard(b, "[q k v]/tp", mesh).requires_grad_()
        with hp.comm.trace() as t:
            y = F.linear(xs, ws, bs)
        assert y.placements[-1] == _StridedShard(2, split_factor=3)
        assert rel_err(y.full_tensor(), ref[0] @ w.T + b) < 1e-6
        sequence_split = "s/tp" in x_spec
        assert [r.kind for r in t.records] == ["all_gather"] * sequence_split
        (y * hp.constrain(g, "b s [q k v]/tp", mesh=mesh)).sum().backward()
        assert tuple(ws.grad.placements)[-1] == ws.placements[-1] and tuple(bs.grad.placements)[-1] == bs.placements[-1]
        for got, want in zip((xs.grad, ws.grad, bs.grad), ref):
            assert rel_err(got.full_tensor(), want.grad) < 1e-5


CUTS = [
    ("x[..., :8]", lambda x: [x[..., :8]], ["8/tp"]),
    ("x[:, :, 8:]", lambda x: [x[:, :, 8:]], ["[8 8]=16/tp"]),
    ("x[..., 8:16]", lambda x: [x[..., 8:16]], ["8/tp"]),
    ("split int", lambda x: x.split(8, dim=-1), ["8/tp"] * 3),
    ("torch.split list", lambda x: torch.split(x, [16, 8], dim=2), ["[8 8]=16/tp", "8/tp"]),
    ("chunk", lambda x: x.chunk(3, dim=-1), ["8/tp"] * 3),
    ("torch.chunk", lambda x: torch.chunk(x, 3, -1), ["8/tp"] * 3),
    ("narrow", lambda x: [x.narrow(-1, 16, 8)], ["8/tp"]),
    ("torch.narrow", lambda x: [torch.narrow(x, 2, 8, 16)], ["[8 8]=16/tp"]),
]


@pytest.mark.parametrize("what, cut, last_dims", CUTS, ids=[c[0] for c in CUTS])
def test_cuts_between_parts_slice_locally(what, cut, last_dims):
    t = torch.randn(2, 3, 24)
    ref = t.clone().requires_grad_()
    want = cut(ref)
    ws = [torch.randn(p.shape) for p in want]
    sum((p * w).sum() for p, w in zip(want, ws)).backward()
    with simulate([("tp", 2)]) as mesh, hp.region():
        x = hp.shard(t, "b s [q k v]/tp", mesh).requires_grad_()
        with hp.comm.trace() as trace:
            got = cut(x)
        assert trace.records == []
        assert [hp.describe(p).split(", ")[-1][:-1] for p in got] == last_dims
        for p, w in zip(got, want):
            assert torch.equal(p.full_tensor(), w.detach())
        sum((p * w).sum() for p, w in zip(got, ws)).backward()
        assert x.grad.placements == x.placements and torch.equal(x.grad.full_tensor(), ref.grad)


@pytest.mark.parametrize(
    "what, cut",
    [("inside a part", lambda x: [x[..., 2:10]]), ("uneven split", lambda x: x.split(5, dim=-1)),
     ("another dim", lambda x: [x[:, 1:]]), ("a step", lambda x: [x[..., ::2]])],
)
def test_other_cuts_are_left_to_dtensor_and_stay_correct(what, cut):
    t = torch.randn(2, 3, 24)
    with simulate([("tp", 2)]) as mesh, hp.region():
        got = cut(hp.shard(t, "b s [q k v]/tp", mesh))
        for p, w in zip(got, cut(t)):
            assert torch.equal(p.full_tensor(), w)


# -- a Phi-3 block and HF Phi-3 against one device ----------------------------


class FusedBlock(nn.Module):
    """Phi-3's layer in small: fused qkv of equal parts, causal attention, fused gate_up with SiLU."""

    def __init__(self, hidden: int = 32, heads: int = 4, inter: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.norm(x))
        q, k, v = qkv[..., :h], qkv[..., h : 2 * h], qkv[..., 2 * h :]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


BLOCK_PLAN = {
    "qkv.weight": "[q k v]/tp in", "qkv.bias": "[q k v]/tp",
    "gate_up.weight": "[gate up]/tp in", "gate_up.bias": "[gate up]/tp",
    "o.weight": "out in/tp", "down.weight": "out in/tp",
}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_fused_block_matches_one_device_with_megatrons_two_allreduces(tp):
    torch.manual_seed(0)
    reference, block = FusedBlock(), FusedBlock()
    block.load_state_dict(reference.state_dict())
    x, w = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    ref_loss = (reference(x) * w).sum()
    ref_loss.backward()
    mesh = hp.mesh(tp=tp, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(block, mesh, BLOCK_PLAN)
        with hp.comm.trace() as t:
            with hp.region():
                loss = (block(x) * w).sum()
            loss.backward()
        assert rel_err(loss.full_tensor(), ref_loss) < 1e-5
        for (name, p), r in zip(block.named_parameters(), reference.parameters()):
            assert p.grad.placements == p.placements, name
            assert rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
    forward, backward = t.select(phase="forward"), t.select(phase="backward")
    assert [(r.kind, r.axis) for r in forward] == [("all_reduce", "tp")] * 2  # o's and down's sums
    assert t.bytes(phase="forward") == 2 * ring_bytes("all_reduce", 2 * 8 * 32 * 4, tp)
    assert [(r.kind, r.axis) for r in backward] == [("all_reduce", "tp")] * 2  # Megatron's f, twice


# HF Phi-3 under every strategy (loss, gradients, collectives, AdamW steps) is in tests/test_zoo.py.


def test_strict_passes_the_fused_path():
    from transformers import AutoModelForCausalLM

    from hp.models import plan_for_type, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("phi3"))
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, dict(plan_for_type("phi3").params))
        ids = torch.randint(0, 128, (2, 8))
        with hp.strict() as recorder:
            loss = model(input_ids=ids, labels=ids).loss
        assert loss.shape == ()
    kernels = [(r.op, r.outputs) for r in recorder.records if r.op.startswith("hp kernel")]
    assert ("hp kernel linear", ["f32[2, 8, [64 64 64]=192/tp]"]) in kernels  # the fused linear ran
    assert ("hp kernel fused_chunk", ["f32[2, 8, 128/tp]"] * 2) in kernels  # and its cuts

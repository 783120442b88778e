"""Reshapes of split dimensions: right numbers or a clear error, never wrong numbers."""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import hp
from hp.ops import flatten

RESHAPES = {
    "split heads": ("b s (heads d)/tp", lambda x, H, D: x.view(x.shape[0], x.shape[1], H, D)),
    "merge heads": ("b s heads/tp d", lambda x, H, D: x.reshape(x.shape[0], x.shape[1], H * D)),
    "merge transposed": (
        "b heads/tp s d", lambda x, H, D: x.transpose(1, 2).reshape(x.shape[0], x.shape[2], H * D)
    ),
    "flatten batch and sequence": ("b s/tp h", lambda x, H, D: x.flatten(0, 1)),
    "unflatten tokens": ("(b s)/tp h", lambda x, H, D: x.unflatten(0, (2, -1))),
}


def _shape(name, H, D, S):
    return {
        "split heads": (2, S, H * D),
        "merge heads": (2, S, H, D),
        "merge transposed": (2, H, S, D),
        "flatten batch and sequence": (2, S, H * D),
        "unflatten tokens": (2 * S, H * D),
    }[name]


@given(
    st.sampled_from(sorted(RESHAPES)), st.sampled_from([2, 4]), st.integers(1, 4), st.sampled_from([2, 4]),
    st.integers(1, 3),
)
def test_reshape_of_a_split_dim_is_exact_or_refused(name, tp, heads_per, D, s_per):
    spec, fn = RESHAPES[name]
    H, S = heads_per * (tp if heads_per % 2 == 0 else 1) or 1, s_per * tp
    shape = _shape(name, H, D, S)
    mesh = hp.mesh(tp=tp, simulate=True)
    t = torch.randn(shape)
    want = fn(t, H, D)
    divisible = all(
        size % tp == 0 for size, dim in zip(shape, hp.layout(spec).dims) if dim.axes
    )
    if not divisible:
        return
    with hp.simulated(mesh), hp.region():
        x = hp.shard(t, spec, mesh)
        try:
            got = fn(x, H, D)
        except hp.RuleError as e:
            assert "cannot run on inputs" in str(e)
            # splitting a split dim works when its major factor divides over the axis
            major = {"split heads": H, "unflatten tokens": 2}.get(name)
            assert major is not None and major % tp, f"{name} refused although it is possible: {e}"
            return
        torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)


def test_split_heads_keeps_the_heads_split():
    mesh = hp.mesh(tp=2, simulate=True)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(torch.randn(2, 3, 4 * 8), "b s (heads d)/tp", mesh)
        y = x.view(2, 3, 4, 8)
        assert str(hp.layout_of(y)) == "2 3 4/tp 8"
        assert str(hp.layout_of(y.reshape(2, 3, 32))) == "2 3 32/tp"


@given(
    st.sampled_from(["b", "b/dp", "b/cp"]), st.sampled_from(["s", "s/cp", "s/dp"]), st.sampled_from(["v", "v/dp", "v/cp"]),
    st.sampled_from([1, 2]), st.sampled_from([2, 4]), st.booleans(),
)
def test_flattening_leading_dims_split_over_two_axes_is_exact_or_refused(b, s, v, b_per, s_per, keep_last):
    """The causal-LM loss's flatten of `b s/cp v` with dp or tp beside (and its way back): values and gradient exact
    on every release."""
    axes = [d.split("/")[1] for d in (b, s, v) if "/" in d]
    assume(len(axes) == len(set(axes)))  # an axis splits one dim
    mesh = hp.mesh(dp=2, cp=2, simulate=True)
    t = torch.randn(2 * b_per, 2 * s_per, 4)
    shape = (-1, 4) if keep_last else (-1,)
    with hp.simulated(mesh), hp.region():
        x = hp.shard(t, f"{b} {s} {v}", mesh).requires_grad_()
        try:
            got = x.view(*shape)
        except hp.RuleError as e:  # some releases refuse what hp leaves to DTensor, never what hp flattens
            assert "cannot run on inputs" in str(e) and flatten.flattened_placements(x.shape, x.placements, mesh.shape, 4 - len(shape)) is None
            return
        torch.testing.assert_close(got.full_tensor(), t.reshape(shape), rtol=0, atol=0)
        if keep_last:  # and back, as a loss views its per-token values per row
            try:
                back = got.view(*t.shape)
            except hp.RuleError:
                assert flatten.unflattened_placements(got.shape, got.placements, mesh.shape, t.shape[0]) is None
            else:
                torch.testing.assert_close(back.full_tensor(), t, rtol=0, atol=0)
        weights = torch.arange(float(t.numel())).reshape(shape)
        (got * hp.shard(weights, "n v" if keep_last else "n", mesh)).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), weights.reshape(t.shape), rtol=0, atol=0)

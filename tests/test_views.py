"""Reshapes of split dimensions: right numbers or a clear error, never wrong numbers."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import hp

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

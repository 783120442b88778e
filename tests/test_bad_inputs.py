"""A corpus of bad layouts, rules and meshes: each fails with a message that names the problem."""

from __future__ import annotations

import re

import pytest
import torch
from layout_strategies import simulate
from torch.distributed.device_mesh import init_device_mesh

import hp

# (layout text, words the message must contain)
SYNTAX = [
    ("b h/tp/tp", "mesh axis 'tp' is used twice"),
    ("b/tp h/tp", "mesh axis 'tp' is used twice"),
    ("b b", "dimension name 'b' is used twice"),
    ("(a b) a", "dimension name 'a' is used twice"),
    ("(a", "'(' is never closed"),
    ("a)", "unexpected character ')'"),
    ("h/", "expected a mesh axis name after '/'"),
    ("h/2", "a mesh axis is named, not numbered"),
    ("+tp b", "dimensions must come before"),
    ("b @cloud", "unknown memory tier '@cloud'"),
    ("... ...", "'...' may appear only once"),
    (".../tp", "'...' cannot be split"),
    ("(a/tp b)", "split a composite dimension as a whole"),
    ("b +tp +tp", "mesh axis 'tp' is used twice"),
    ("b/tp +tp", "both splits a dimension and holds a partial sum"),
    ("a,b", "unexpected character ','"),
    ("()", "empty composite dimension"),
    ("((a))", "composite dimensions cannot nest"),
    ("/tp", "'/' must follow a dimension name"),
    ("b @host @disk", "the memory tier '@' is given twice"),
    ("(a ...)", "'...' cannot stand inside a composite"),
    ("b +", "expected a mesh axis name after '+'"),
    ("b-1 h", "unexpected character '-'"),
    ("b h/tp!", "unexpected character '!'"),
    ("b (h d)x", "unexpected character 'x'"),
]


@pytest.mark.parametrize("text, words", SYNTAX)
def test_bad_syntax(text, words):
    with pytest.raises(hp.LayoutError, match=re.escape(words)):
        hp.layout(text)


def test_caret_points_at_the_offending_token():
    with pytest.raises(hp.LayoutError) as err:
        hp.layout("b s/cp h/cp")
    problem, text, caret = str(err.value).splitlines()
    assert text == "  b s/cp h/cp"
    assert caret == "           ^^"


def _shard(t, spec, **kw):
    return lambda mesh: hp.shard(t, spec, mesh, **kw)


def _with_rules(bindings, fn):
    def run(mesh):
        with hp.rules(**bindings):
            return fn(mesh)

    return run


M = torch.zeros(4, 4)
# (what, call on a dp=2 x tp=2 simulated mesh, words the message must contain)
ON_A_MESH = [
    ("unknown mesh axis", _shard(M, "b h/cp"), "unknown mesh axis 'cp' (the mesh has dp=2, tp=2)"),
    ("unknown partial axis", _shard(M, "b h +ep"), "unknown mesh axis 'ep'"),
    ("rank too high", _shard(M, "b s h"), "layout has 3 dims but the tensor has 2"),
    ("rank too low", _shard(M, "b"), "layout has 1 dims but the tensor has 2"),
    ("ellipsis needs more", _shard(torch.zeros(4), "a b ... c"), "needs at least 3 dims"),
    ("indivisible", _shard(torch.zeros(3, 4), "b/dp h"), "size 3, not divisible by its 2 shards"),
    ("indivisible 2D", _shard(torch.zeros(6, 4), "b/dp/tp h"), "not divisible by its 4 shards"),
    ("written size", _shard(M, "8 h"), "written as size 8 but the tensor has 4"),
    ("tier on device", _shard(M, "b h @host"), "cannot be placed by hand"),
    ("not a layout", _shard(M, 3), "a layout is a string"),
    (
        "rule against explicit",
        _with_rules({"batch": "tp"}, _shard(M, "batch h/tp")),
        "rules conflict in layout 'batch h/tp'",
    ),
    (
        "two rules, one axis",
        _with_rules({"a": "tp", "b": "tp"}, _shard(M, "a b")),
        "mesh axis 'tp' is used twice",
    ),
    ("rule to unknown axis", _with_rules({"batch": "ep"}, _shard(M, "batch h")), "unknown mesh axis 'ep'"),
    (
        "explicit rules conflict",
        _shard(M, "a b/dp", rules={"a": ("dp", "tp")}),
        "rules conflict",
    ),
    ("constrain a plain tensor", lambda mesh: hp.constrain(M, "b h/tp"), "pass mesh="),
    (
        "from_local impossible block",
        lambda mesh: hp.from_local(torch.zeros(2, 3), "b h/tp", mesh, shape=(2, 9)),
        "a local block of 3 cannot be one of 2 shards of a global size 9",
    ),
    (
        "from_local shape rank",
        lambda mesh: hp.from_local(torch.zeros(2, 3), "b h/tp", mesh, shape=(2, 3, 1)),
        "has 3 dims but the local tensor has 2",
    ),
    ("layout_of a plain tensor", lambda mesh: hp.layout_of(M), "needs a DTensor, got Tensor"),
]


@pytest.mark.parametrize("what, call, words", ON_A_MESH, ids=[c[0] for c in ON_A_MESH])
def test_bad_layout_on_a_mesh(what, call, words):
    with simulate([("dp", 2), ("tp", 2)]) as mesh:
        with pytest.raises(hp.LayoutError, match=re.escape(words)):
            call(mesh)
    assert hp.layouts.active_rules() is None  # a failure inside `with hp.rules` leaves none behind


BAD_RULES = [
    ({"batch": 3}, "must bind to a mesh axis name"),
    ({"2x": "tp"}, "'2x' is not a dimension name"),
    ({"batch": ("dp", "dp")}, "names a mesh axis twice"),
    ({"batch": "d p"}, "must bind to a mesh axis name"),
]


@pytest.mark.parametrize("bindings, words", BAD_RULES)
def test_bad_rules(bindings, words):
    with pytest.raises(hp.LayoutError, match=re.escape(words)):
        hp.rules(bindings)


def test_uneven_split_against_mesh_order_is_refused():
    with simulate([("y", 2), ("x", 2)]) as mesh:
        with pytest.raises(hp.LayoutError, match="unevenly over axes against mesh order"):
            hp.shard(torch.zeros(7), "h/x/y", mesh, uneven=True)


def test_a_mesh_without_axis_names_is_refused():
    with simulate([("tp", 2)]):
        unnamed = init_device_mesh("cpu", (2,))
        with pytest.raises(hp.LayoutError, match="the mesh has no axis names"):
            hp.shard(torch.zeros(4), "b/tp", unnamed)


BAD_MESHES = [
    (lambda: hp.mesh(tp=0, simulate=True), "mesh axis 'tp' has size 0"),
    (lambda: hp.mesh(tp=-2, simulate=True), "has size -2"),
    (lambda: hp.mesh(tp=2.5, simulate=True), "has size 2.5"),
    (lambda: hp.mesh(tp=True, simulate=True), "has size True"),
    (lambda: hp.mesh("tp=2 tp=2", simulate=True), "mesh axis 'tp' is given twice"),
    (lambda: hp.mesh([("dp", 2)], dp=2, simulate=True), "mesh axis 'dp' is given twice"),
    (lambda: hp.mesh("tp", simulate=True), "must be written name=size"),
    (lambda: hp.mesh("tp=two", simulate=True), "has size 'two'"),
    (lambda: hp.mesh(simulate=True), "needs at least one axis"),
    (lambda: hp.mesh([("1x", 2)], simulate=True), "'1x' is not an identifier"),
]


@pytest.mark.parametrize("call, words", BAD_MESHES)
def test_bad_mesh(call, words):
    with pytest.raises(hp.MeshError, match=re.escape(words)):
        call()

"""The layout notation: parsing, canonical printing, round trips, value semantics."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import any_layout

import hp
from hp.layouts.types import Dim


@given(any_layout())
def test_print_then_parse_round_trips(layout):
    text = str(layout)
    again = hp.layout(text)
    assert again == layout
    assert str(again) == text
    assert hash(again) == hash(layout)


@given(any_layout(), st.integers(1, 3))
def test_extra_whitespace_parses_to_the_same_layout(layout, pad):
    spaced = (" " * pad).join(str(layout).split(" "))
    assert hp.layout(f" {spaced}\t") == layout


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("b s/cp h/tp", "b s/cp h/tp"),
        ("b  s   h", "b s h"),
        ("h/tpx/tpy", "h/tpx/tpy"),
        ("b s h +tp", "b s h +tp"),
        ("b +tp +dp", "b +dp +tp"),  # partial axes print sorted: one canonical form
        ("b @device", "b"),  # device is the default tier
        ("b s/cp h/tp @host", "b s/cp h/tp @host"),
        ("( heads  d )/tp", "(heads d)/tp"),
        ("... h/tp", "... h/tp"),
        ("8/dp 1 h", "8/dp 1 h"),
        ("[ q k  v ]/tp in", "[q k v]/tp in"),
        ("[q:64 k:016 v:16] in", "[q:64 k:16 v:16] in"),  # sizes print as numbers
        ("b [gate up]/tp", "b [gate up]/tp"),
        ("[32 32]/tp", "[32 32]/tp"),  # anonymous parts are their sizes
        ("", ""),
        ("+tp", "+tp"),
    ],
)
def test_canonical_form(text, canonical):
    assert str(hp.layout(text)) == canonical


def test_structure_of_a_parsed_layout():
    L = hp.layout("b/dp (heads d)/tp/x ... +cp @disk")
    assert L.dims[0] == Dim(("b",), ("dp",))
    assert L.dims[1] == Dim(("heads", "d"), ("tp", "x"), composite=True)
    assert L.dims[2].is_ellipsis
    assert L.partial == ("cp",) and L.tier == "disk"
    assert L.sharded_axes == ("dp", "tp", "x") and L.axes == ("dp", "tp", "x", "cp")
    assert L.rank is None and hp.layout("a b").rank == 2


def test_structure_of_a_fused_dim():
    L = hp.layout("[q:64 k:16 v:16]/tp (heads d) [16 16]")
    assert L.dims[0] == Dim(("q", "k", "v"), ("tp",), fused=True, sizes=(64, 16, 16))
    assert L.dims[2] == Dim(("16", "16"), fused=True) and L.dims[2].sizes == (16, 16)
    assert hp.layout("[q k v]").dims[0].part_sizes(96) == (32, 32, 32)
    assert L.dims[0].size is None and not L.dims[0].is_ellipsis


def test_layouts_are_immutable_and_hashable():
    L = hp.layout("b h/tp")
    with pytest.raises(AttributeError):
        L.dims = ()
    assert {L: 1}[hp.layout("b  h/tp")] == 1
    assert hp.layout(L) is L


def test_ellipsis_expands_to_anonymous_dims():
    assert str(hp.layout("... h/tp").expand((2, 3, 8))) == "2 3 h/tp"
    assert str(hp.layout("b ... h").expand((2, 8))) == "b h"

"""Layouts: the notation, its value type, logical-axis rules, DTensor placements, annotate API.

The lowest layer of hp's own: it may import torch and nothing of hp outside itself.
"""

from hp.layouts.annotate import constrain, describe, from_local, layout_of, shard
from hp.layouts.errors import LayoutError
from hp.layouts.types import Dim, Layout
from hp.layouts.parse import layout
from hp.layouts.placements import bind, from_placements, to_placements
from hp.layouts.rules import Rules, active_rules, rules

__all__ = [
    "Dim", "Layout", "LayoutError", "Rules", "active_rules", "bind", "constrain", "describe",
    "from_local", "from_placements", "layout", "layout_of", "rules", "shard", "to_placements",
]

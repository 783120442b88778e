"""Hypothesis settings for the suite (HP_EXAMPLES sets the examples per property)."""

from __future__ import annotations

import os
from hypothesis import HealthCheck, settings

settings.register_profile(
    "hp",
    deadline=None,
    max_examples=int(os.environ.get("HP_EXAMPLES", "30")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("hp")

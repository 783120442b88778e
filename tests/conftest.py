"""The suite's settings: hypothesis (HP_EXAMPLES sets the examples per property), and the order of its files."""

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

# Files holding the longest single tests (`python -m pytest --durations=25`), run first so that
# the suite ends on short tests on both xdist workers rather than on one long test on one of them.
# Whole files move, in their own order, so each module's fixtures are still set up once per worker.
LONGEST_FIRST = (
    "test_gloo.py", "test_train_preference.py", "test_train.py", "test_train_launch.py", "test_failures.py",
    "test_ring_attention.py", "test_llamafactory_examples.py", "test_tp2d.py", "test_packaging.py",
    "test_qwen_vl.py", "test_offload.py", "test_train_moe.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: files stay contiguous

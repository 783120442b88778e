"""The suite's settings: one thread per process, hypothesis (HP_EXAMPLES sets the examples per property), and
the order of its files."""

from __future__ import annotations

import os
import sys

# One compute thread per process, set before torch is imported. The suite runs two xdist workers (and the
# ranks they fork) on two cores; torch's default of one thread per core gives each worker a second thread that
# spins against the other worker for the core (measured: simulated tests took 1.7 times the core-seconds).
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:  # a plugin imported it first: the variable came too late for its thread pool
    sys.modules["torch"].set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402

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


def pytest_collection_finish(session) -> None:
    # What collection imported (torch, transformers, hp, the zoo's models: millions of objects) lives as long
    # as the worker: frozen, the collector no longer walks it on every full collection; and the young
    # generation is collected less often, since the simulated tests allocate small objects by the million.
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

"""Markers for tests of what hp runs on some torch releases only (and refuses, by name, on the others).

FSDP needs `fully_shard(dp_mesh_dims=...)` (torch 2.13): on torch 2.11 hp refuses it before any
worker starts, which tests/test_backports.py checks, and the tests that run FSDP skip there.
"""

from __future__ import annotations

import pytest
import torch

from hp.backports import FSDP_ON_THE_WHOLE_MESH

needs_fsdp = pytest.mark.skipif(not FSDP_ON_THE_WHOLE_MESH,
                                reason=f"torch {torch.__version__} has no fully_shard(dp_mesh_dims=...): hp refuses FSDP")

"""The README's main command runs and its numbers match the unsharded model."""

from __future__ import annotations

import json
import rank_pool
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_annotate_mlp_example_matches_one_device():
    run = rank_pool.python(str(ROOT / "examples" / "annotate_mlp.py"), "--simulate", "4", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ranks"] == 4
    assert result["out_layout_before_constrain"].endswith("+tp")
    assert result["loss_rel_err"] < 1e-5 and result["grad_rel_err"] < 1e-5

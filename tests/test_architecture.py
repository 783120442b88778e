"""The rules of the house: the layers, no import circle, no module over 500 lines.

The layering contract lives in `pyproject.toml` (`[tool.importlinter]`) and is
checked by import-linter's `lint-imports`, the maintained tool, not by a walker
of our own. It runs on hp laid out as pip installs it: the zoo (`models/`)
inside `hp/` as `hp.models`, so its imports count like any other package's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_the_import_contracts_hold(tmp_path):
    shutil.copytree(ROOT / "hp", tmp_path / "hp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "models", tmp_path / "hp" / "models", ignore=shutil.ignore_patterns("__pycache__"))
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout, run.stdout[-4000:]


def test_no_module_is_longer_than_the_house_allows():
    long = {str(p.relative_to(ROOT)): n for p in [*ROOT.glob("hp/**/*.py"), *ROOT.glob("models/**/*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concept (at most {MAX_LINES} lines each): {long}"


def test_every_package_says_what_it_holds_and_may_import():
    for init in [*ROOT.glob("hp/**/__init__.py"), ROOT / "models" / "__init__.py"]:
        doc = init.read_text().lstrip()
        assert doc.startswith('"""'), f"{init.relative_to(ROOT)} has no docstring"
        assert init.parent.name == "hp" or "import" in doc.split('"""')[1], \
            f"{init.relative_to(ROOT)}'s docstring does not say what the package may import"

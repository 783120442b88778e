"""`hp.models` imports however hp is installed or run, and `hp train` runs from a checkout over a regular install.

The zoo lives in the top-level `models/` and is installed as `hp.models`. A
regular install copies it into `hp/models`; a checkout keeps it beside `hp/`,
and a checkout is what Python imports whenever its root comes first on
`sys.path` (`python -m`, `python -c`, or the zygote `hp train` starts from
the repository root on an accelerator, `python -m hp.train.zygote`). `hp.compat.models_finder` bridges that case; these tests
install hp for real into a temporary directory and run fresh interpreters.

This environment may hold an editable install of the checkout, whose finder
(loaded by a `__editable__` .pth file in site-packages) also answers
`hp.models` and would hide a broken source tree. The subprocess runs below
therefore put a `sitecustomize` first on PYTHONPATH that drops that finder,
in every process they start (the training workers too), and the import runs
assert which copy of hp they got.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gloo_launch import _free_port, clean_env

from hp.compat import models_finder

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
WITHOUT_EDITABLE = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""
PRINT_FILES = "import hp.models.llama, hp; print(hp.__file__); print(hp.models.llama.__file__)"


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> dict[str, Path]:
    """A regular `pip install` of this checkout into a directory, and a sitecustomize that drops the editable finder."""
    pytest.importorskip("setuptools", minversion="70.1", reason="built without isolation, so without the network")
    tmp = tmp_path_factory.mktemp("packaging")
    # pip builds in the source directory (build/, hp.egg-info): build a copy, so the checkout stays as it is
    source = tmp / "source"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in ("hp", "models"):
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]
    assert (site / "hp" / "models" / "llama.py").is_file() and (site / "bin" / "hp").is_file()
    custom = tmp / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text(WITHOUT_EDITABLE)
    return {"site": site, "custom": custom, "elsewhere": tmp}


def env_with(pythonpath: list[Path]) -> dict[str, str]:
    """One thread per process, no launcher variables, and exactly `pythonpath`."""
    return {**clean_env(), "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}


@pytest.fixture(scope="module")
def imported(install) -> dict[str, tuple[Path, Path] | str]:
    """Per setup, `hp/__init__.py` and `hp/models/llama.py` as a fresh interpreter imports them (or its error).

    The interpreters start together: each spends its seconds importing torch.
    """
    custom, site = install["custom"], install["site"]
    setups = {"elsewhere": install["elsewhere"], "checkout": ROOT}
    probes = {
        name: subprocess.Popen([sys.executable, "-c", PRINT_FILES], cwd=cwd, env=env_with([custom, site]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cwd in setups.items()
    }
    results = {}
    for name, probe in probes.items():
        out, err = probe.communicate(timeout=120)
        results[name] = tuple(map(Path, out.split())) if probe.returncode == 0 else err[-3000:]
    return results


def test_a_regular_install_imports_its_own_zoo_from_another_directory(install, imported):
    site = install["site"]
    assert imported["elsewhere"] == (site / "hp" / "__init__.py", site / "hp" / "models" / "llama.py")


def test_a_checkout_shadowing_a_regular_install_imports_the_top_level_zoo(imported):
    """From the repository root the checkout's hp wins over the install, and has no hp/models of its own."""
    assert imported["checkout"] == (ROOT / "hp" / "__init__.py", ROOT / "models" / "llama.py")


def test_the_finder_answers_only_for_a_source_tree(tmp_path, monkeypatch):
    """A checkout (or a source tree on PYTHONPATH) gets the finder, once; an installed copy and a lone hp/ do not."""
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, models_finder.ModelsFinder)])
    for folder in ("tree/hp", "tree/models", "installed/hp/models", "lone/hp"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tree" / "models" / "__init__.py").write_text("")
    assert models_finder.install(tmp_path / "installed" / "hp") is None
    assert models_finder.install(tmp_path / "lone" / "hp") is None
    finder = models_finder.install(tmp_path / "tree" / "hp")
    assert sys.meta_path[0] is finder and models_finder.install(tmp_path / "tree" / "hp") is finder
    spec = finder.find_spec("hp.models")
    assert spec.origin == str(tmp_path / "tree" / "models" / "__init__.py")
    assert spec.submodule_search_locations == [str(tmp_path / "tree" / "models")]
    assert finder.find_spec("models") is None and finder.find_spec("hp") is None


def test_hp_from_the_checkout_imports_the_checkouts_zoo():
    """In this process (an editable install, or a source tree first on sys.path) as in any other."""
    import hp

    if Path(hp.__file__) != ROOT / "hp" / "__init__.py":
        pytest.skip(f"hp comes from an installed copy here: {hp.__file__}")
    assert Path(importlib.import_module("hp.models.llama").__file__) == ROOT / "models" / "llama.py"


def test_hp_train_from_the_repository_root_over_a_regular_install(install, tmp_path):
    """The installed `hp` command launches from the repository root, and its workers train (on CPU forked from the
    launcher, which imported the install; the checkout's own imports from here are the tests above)."""
    command = [str(install["site"] / "bin" / "hp"), "train", QUICKSTART, f"dataset_dir={ROOT / 'examples' / 'data'}",
               f"output_dir={tmp_path / 'out'}", f"master_port={_free_port()}", "max_steps=1",
               "per_device_train_batch_size=4"]
    result = subprocess.run(command, cwd=ROOT, env=env_with([install["custom"], install["site"]]),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["comm_bytes_per_step"]["tp"] > 0


def test_every_package_of_the_tree_is_one_the_install_lists():
    """pyproject.toml lists hp's packages by name: a subpackage left out is missing from a regular install (its
    commands fail there with ModuleNotFoundError), while the checkout's own imports still find it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "hp").rglob("__init__.py")}
    assert tree <= listed, f"packages missing from pyproject.toml: {sorted(tree - listed)}"

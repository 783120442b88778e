"""`hp.models` from a source tree, where the zoo sits beside `hp/` rather than inside it.

The model zoo lives in the repository's top-level `models/` and is installed
as the subpackage `hp.models` (pyproject maps one to the other). An install,
regular or editable, takes care of that mapping; a bare source tree does not.
And a source tree is what Python imports whenever the repository root comes
first on `sys.path`: `hp train` starts its workers with `python -m` from the
current directory, so run from a checkout, every worker imports the checkout's
`hp/` even when hp is installed, and `hp/models` is not there.

So when `hp` is imported from a directory that has no `hp/models` but a
sibling `models/` package, one narrow finder goes first on `sys.meta_path`:
it answers for the single name `hp.models` with that directory, and the
package's `__path__` then finds its submodules (`hp.models.llama`) the usual
way. Going first keeps the zoo the one beside the `hp` actually imported,
even where an editable install of another checkout would answer as well; no
other name, top-level or not, is claimed. Importing this module does it, and
`hp/__init__.py` imports it first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

NAME = "hp.models"
HP_DIR = Path(__file__).resolve().parent.parent  # hp/, two up from hp/compat/models_finder.py


class ModelsFinder(importlib.abc.MetaPathFinder):
    """Resolves exactly `hp.models` to `directory` (a package with an `__init__.py`).

    >>> finder = ModelsFinder(Path("/src/models"))
    >>> finder.find_spec("hp.models").submodule_search_locations
    ['/src/models']
    >>> finder.find_spec("hp.models.llama") is None  # submodules come from the package's __path__
    True
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, self.directory / "__init__.py", submodule_search_locations=[str(self.directory)]
        )

    def __repr__(self) -> str:
        return f"ModelsFinder({str(self.directory)!r})"


def install(package_dir: Path = HP_DIR) -> ModelsFinder | None:
    """Put a `ModelsFinder` first on `sys.meta_path` if `package_dir` (hp's) is a source tree; returns it or None.

    Nothing is installed where `hp/models` exists (an installed copy) or no
    sibling `models/` package does, nor a second time.
    """
    zoo = package_dir.parent / "models"
    if (package_dir / "models").exists() or not (zoo / "__init__.py").is_file():
        return None
    for finder in sys.meta_path:
        if isinstance(finder, ModelsFinder):
            return finder
    finder = ModelsFinder(zoo)
    sys.meta_path.insert(0, finder)
    return finder


install()

"""How an `hp train` run ends: its exit code and the one message its user reads.

A run that fails should say so once, in a line that names the key, file or
record at fault, whatever rank it failed on. So every failure goes through
here: the launcher prints its own (bad input found before any worker
starts), each worker writes its failure to a file of the launcher's
(`HP_ERRORS`), and the launcher prints rank 0's (or the lowest failed
rank's) after the workers stopped. Tracebacks are for developers: they are
printed only when debugging (`hp train --debug`, or `HP_DEBUG=1`).

Exit codes (docs/troubleshooting.md shows what each means to a user):

    0    the run finished
    1    it failed during training (a non-finite loss, a crash in a worker)
    2    bad input: the config, data, model directory, output_dir or checkpoint
    130  interrupted (SIGINT or SIGTERM)
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from hp.train.config import ConfigError

FINISHED, FAILED, BAD_INPUT, INTERRUPTED = 0, 1, 2, 130
# How a collective that waited out its timeout fails (gloo, gloo after the pair closed, nccl's and hccl's watchdog).
TIMEOUT_SIGNS = ("Timed out waiting", "Application timeout caused pair closure",
                 "Watchdog caught collective operation timeout")
# Where torch's collectives live, and the names there that are not collectives (decorators, helpers).
_COLLECTIVE_FILES = ("/torch/distributed/distributed_c10d.py", "/torch/distributed/_functional_collectives.py")
_NOT_COLLECTIVES = ("_", "wrapper", "unwrap", "trigger_wait")
_PACKAGES = ("/site-packages/", "/dist-packages/")
_STDLIB = sysconfig.get_paths()["stdlib"].replace(os.sep, "/")
DEBUG_ENV = "HP_DEBUG"
ERRORS_ENV = "HP_ERRORS"  # the directory where workers leave their failures for the launcher


class TrainingError(RuntimeError):
    """A run that started but cannot go on (e.g. its loss stopped being finite); exit code 1."""


def debugging() -> bool:
    """Whether to show everything: tracebacks, and the elastic launcher's own log.

    >>> isinstance(debugging(), bool)
    True
    """
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def exit_code(error: BaseException) -> int:
    """The exit code a run ending in `error` has.

    >>> exit_code(ConfigError("x")), exit_code(TrainingError("y")), exit_code(KeyboardInterrupt())
    (2, 1, 130)
    """
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, ConfigError):
        return BAD_INPUT
    return FAILED


def message(error: BaseException) -> str:
    """The message a user reads for `error`: its own words when they name the problem, else its type too.

    >>> message(ConfigError("learning_rate = 'fast': expected a number"))
    "learning_rate = 'fast': expected a number"
    >>> message(RuntimeError("boom"))
    'RuntimeError: boom (hp train --debug shows the traceback)'
    """
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, (ConfigError, TrainingError)):
        return str(error)
    hint = "" if debugging() else " (hp train --debug shows the traceback)"
    return f"{type(error).__name__}: {error}{hint}"


def report(error: BaseException, command: str = "hp train") -> int:
    """Print `error` as `hp train: ...` on stderr (its traceback first when debugging); returns its exit code."""
    if debugging():
        traceback.print_exception(error)
    print(f"{command}: {message(error)}", file=sys.stderr, flush=True)
    return exit_code(error)


def record(error: BaseException, rank: int) -> int:
    """A worker's failure: written for the launcher (and its traceback printed when debugging); the exit code.

    The record says where the worker was (`call_site`), and a collective that timed out is recorded as
    kind "timeout", so that the launcher can name the collective and the ranks that never joined it."""
    if debugging():
        traceback.print_exception(error)
    status = exit_code(error)
    text = message(error)
    kind = "timeout" if any(sign in text for sign in TIMEOUT_SIGNS) else type(error).__name__
    entry = {"rank": rank, "exit_code": status, "message": text, "kind": kind,
             **call_site(traceback.extract_tb(error.__traceback__))}
    if not _write(entry) and not debugging():
        print(f"hp train: rank {rank}: {text}", file=sys.stderr, flush=True)
    return status


def stopped(rank: int, frame: FrameType | None) -> None:
    """A worker stopped by its launcher (its peers failed): where it was, for the launcher's message."""
    _write({"rank": rank, "exit_code": INTERRUPTED, "message": "stopped by the launcher", "kind": "stopped",
            **call_site(traceback.extract_stack(frame))})


def call_site(frames: Sequence[traceback.FrameSummary]) -> dict[str, str]:
    """Where a worker was: `where`, its two innermost frames outside torch and Python's own library (in
    different files: hp's or the model's code, and what called it), and `collective`, the torch.distributed
    collective it was in, if any (frames: outermost first).

    >>> "in <module>" in call_site(traceback.extract_stack())["where"]
    True
    """
    collective, places = None, []
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        if collective is None and path.endswith(_COLLECTIVE_FILES) and not frame.name.startswith(_NOT_COLLECTIVES):
            collective = frame.name
        if "/torch/" not in path and not _python_own(path) and all(p.filename != frame.filename for p in places):
            places.append(frame)
    found = {"collective": collective} if collective else {}
    if places:
        found["where"] = ", from ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in places[:2])
    return found


def _python_own(path: str) -> bool:
    return path.startswith(_STDLIB) and not any(root in path for root in _PACKAGES)


def _short(path: str) -> str:
    """A source path as its package spells it (hp/train/loop.py, transformers/...), else as given."""
    for root in _PACKAGES:
        if root in path:
            return path.split(root, 1)[1]
    here = f"{os.getcwd().replace(os.sep, '/')}/"
    return path[len(here):] if path.startswith(here) else path


def _write(entry: dict) -> bool:
    """Leave `entry` for the launcher (`HP_ERRORS`); False when no launcher asked for it."""
    directory = os.environ.get(ERRORS_ENV)
    if directory:
        Path(directory, f"{entry['rank']}.json").write_text(json.dumps(entry))
    return bool(directory)


def all_recorded(directory: str | os.PathLike) -> list[dict]:
    """Every failure the workers recorded in `directory` (rank, exit_code, message), by rank.

    >>> import tempfile
    >>> all_recorded(tempfile.mkdtemp())
    []
    """
    found = []
    for path in Path(directory).glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a worker killed while writing: the others still say what happened
    return sorted(found, key=lambda r: r["rank"])

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
import traceback
from pathlib import Path

from hp.train.config import ConfigError

FINISHED, FAILED, BAD_INPUT, INTERRUPTED = 0, 1, 2, 130
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
    """A worker's failure: written for the launcher (and its traceback printed when debugging); the exit code."""
    if debugging():
        traceback.print_exception(error)
    status = exit_code(error)
    directory = os.environ.get(ERRORS_ENV)
    if directory:
        path = Path(directory, f"{rank}.json")
        path.write_text(json.dumps({"rank": rank, "exit_code": status, "message": message(error),
                                    "kind": type(error).__name__}))
    elif not debugging():
        print(f"hp train: rank {rank}: {message(error)}", file=sys.stderr, flush=True)
    return status


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

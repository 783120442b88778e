"""A function run in processes forked from this one, and rank 0's answer taken back.

Why: `parallel: auto` searches before the launch, and a search leaves a fake
world behind in the process that ran it, which the launcher must not carry
into its workers; measuring a CPU pins a core and a thread count, and its
link needs two processes. Each of those runs in forked processes, so that
the caller stays as it was. A child that raises hands its exception back (it
is raised here); one that dies first is said, with its exit code, rather
than waited for.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
from collections.abc import Callable
from typing import Any


def forked(target: Callable[..., Any], *args: Any, ranks: int = 1, what: str = "a forked process") -> Any:
    """`target(rank, ranks, *args)` in `ranks` processes forked from this one: what rank 0 returns (`what` names
    them in the message of one that dies first).

    >>> forked(lambda rank, ranks, x: x * ranks, 21, ranks=2)
    42
    >>> forked(lambda rank, ranks: 1 / 0)
    Traceback (most recent call last):
    ...
    ZeroDivisionError: division by zero
    >>> import os
    >>> forked(lambda rank, ranks: os._exit(3), what="a check")
    Traceback (most recent call last):
    ...
    RuntimeError: a check ended (exit code 3) before it answered
    """
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    processes = [context.Process(target=_answer, args=(target, rank, ranks, out, args)) for rank in range(ranks)]
    for process in processes:
        process.start()
    try:
        found = _first(out, processes, what)
        if isinstance(found, BaseException):
            raise found
    except BaseException:
        for process in processes:  # its peers may wait for it in a collective
            process.terminate()
        raise
    for process in processes:
        process.join()
    return found


def _answer(target: Callable[..., Any], rank: int, ranks: int, out, args: tuple) -> None:
    try:
        answer = target(rank, ranks, *args)
    except Exception as error:  # noqa: BLE001 - the parent raises it, with its message
        out.put(_sendable(error))
        return
    if rank == 0:
        out.put(answer)


def _first(out, processes: list, what: str) -> Any:
    """The first thing a child puts; a child that ended without putting it is an error."""
    while True:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead or not any(p.is_alive() for p in processes):
                raise RuntimeError(f"{what} ended (exit code {dead[0] if dead else 0}) before it answered") from None


def _sendable(error: Exception) -> Exception:
    """`error`, or one of its base kind with its message where it does not survive pickling (an exception whose
    constructor takes other arguments than its message)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error))
    return error

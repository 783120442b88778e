"""One launched worker of `hp train`: read the config, train, and end as the launcher expects.

Three things make a worker a good citizen of its launcher:

- It dies with the launcher, however the launcher ends (even SIGKILL, which
  nothing can catch): Linux's parent-death signal is set first thing (its
  parent is the node's zygote, `hp.train.zygote`, which dies with the
  launcher), so no training keeps running, orphaned, in the background. It
  is named `hp rank N` where `ps` and `top` show it. SIGINT and SIGTERM
  (Ctrl-C, or the launcher stopping its workers) end it at once and quietly:
  a KeyboardInterrupt could land anywhere, even in a destructor, and print a
  traceback; checkpoints are atomic, so stopping mid-save leaves none
  half-written.
- A failure is recorded for the launcher (`hp.train.errors.record`), which
  prints one message for the whole run, instead of every rank printing a
  traceback.
- torch 2.13's gloo sometimes aborts in its destructors at interpreter exit
  ("terminate called without an active exception") after a run has
  finished, and the launcher would report a failed run. The worker tears the
  process group down itself, flushes its output and leaves with `os._exit`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch.distributed as dist

from hp.train import errors, restarts

LAUNCHER_ENV = "HP_LAUNCHER_PID"  # the process whose death must end this worker
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def main(argv: list[str] | None = None) -> None:
    from hp.train.config import load_config
    from hp.train.loop import train

    die_with(int(os.environ.get(LAUNCHER_ENV, "0")))
    _name(f"hp rank {os.environ.get('RANK', '0')}")
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _interrupted)
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = load_config(argv[0], argv[1:])
        if restarts.restarted():  # the group restarted after a worker died: go on from the last checkpoint
            config = load_config(argv[0], [*argv[1:], *restarts.resume_overrides(config.output_dir)])
        train(config)
    except BaseException as error:  # noqa: BLE001 - every way a worker ends is recorded for the launcher
        _end_progress_line()
        _leave(errors.record(error, int(os.environ.get("RANK", "0"))))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _leave(errors.FINISHED)


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux); leave now if it already has."""
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was set
        _leave(errors.INTERRUPTED)


def _name(name: str) -> None:
    """The process's name as `ps` and `top` show it (Linux; at most 15 bytes)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _interrupted(signum, frame) -> None:
    for stop in (signal.SIGINT, signal.SIGTERM):  # the agent passes on a Ctrl-C the worker may have seen too
        signal.signal(stop, signal.SIG_IGN)
    _end_progress_line()
    errors.stopped(int(os.environ.get("RANK", "0")), frame)  # where it was: the rank its peers waited for?
    _leave(errors.INTERRUPTED)


def _end_progress_line() -> None:
    """End rank 0's progress bar line: the launcher's message follows on a line of its own."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write("\n")


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


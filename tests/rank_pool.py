"""A pool of gloo ranks, started once per pytest worker and reused by every multi-process test.

Why: starting a rank costs seconds (Python, torch, transformers and hp
imported anew), and a torchrun launch starts an agent and 2-4 of them. The
suite ran about forty such launches, and their start-up was most of its time.
Here four rank processes start once (lazily, on first use) and wait for jobs.

A job is a script run as torchrun would run it, on the first `world` ranks of
the pool: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` / `MASTER_PORT` (a fresh port,
so each job's `init_process_group` builds a fresh gloo world) and `sys.argv`
are set, and the script runs as `__main__`. Its stdout and stderr go to files
and come back as a `subprocess.CompletedProcess` (rank 0's output last), so
callers check it exactly as a torchrun result. Between jobs each rank tears
down what a job may leave: the process group, torch.compile's caches, the
environment, the working directory. A job that fails or outlives its timeout
takes the pool down with it (a rank stuck in a collective cannot be
recovered), and the next job starts a fresh one.

Tests that check the launcher itself (its messages, signals, timeouts, several
nodes) still launch for real (`gloo_launch.torchrun`, `train_runs.hp_train(...,
launcher=True)`), and so do the compiled runs: `torch.compile` in a rank that
had run other jobs failed to trace or to partition graphs that it compiles in
a fresh process, even after `torch._dynamo.reset()`.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import _free_port, clean_env

SIZE = 4  # the most ranks a test uses
HERE = Path(__file__).resolve().parent


class RankPool:
    """`SIZE` rank processes waiting for jobs on their stdin; results come back on a pipe of their own."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self.ranks: list[subprocess.Popen] = []
        self.replies: list = []

    def _start(self) -> None:
        for rank in range(self.size):
            read, write = os.pipe()
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(rank), str(write)],
                                    stdin=subprocess.PIPE, env=clean_env(), cwd=HERE.parent, text=True,
                                    pass_fds=(write,), start_new_session=True)
            os.close(write)
            self.ranks.append(proc)
            self.replies.append(os.fdopen(read))

    def stop(self) -> None:
        for proc in self.ranks:
            proc.kill()
            proc.wait()
        for reply in self.replies:
            reply.close()
        self.ranks, self.replies = [], []

    def run(self, script: str, world: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run `script` with `args` on ranks 0..world-1, as `torchrun --nproc-per-node world` would."""
        assert 1 <= world <= self.size, f"the pool has {self.size} ranks, not {world}"
        if not self.ranks or any(p.poll() is not None for p in self.ranks):
            self.stop()
            self._start()
        port = _free_port()
        with tempfile.TemporaryDirectory(prefix="hp-pool-") as outputs:
            for rank in range(world):
                job = {"script": str(script), "args": list(args), "world": world, "port": port,
                       "out": f"{outputs}/{rank}.out", "err": f"{outputs}/{rank}.err"}
                self.ranks[rank].stdin.write(json.dumps(job) + "\n")
                self.ranks[rank].stdin.flush()
            codes = self._wait(world, timeout, script)
            out = "".join(Path(f"{outputs}/{r}.out").read_text() for r in reversed(range(world)))
            err = "".join(Path(f"{outputs}/{r}.err").read_text() for r in reversed(range(world)))
        failed = [r for r, code in enumerate(codes) if code != 0]
        if failed:
            self.stop()  # the ranks that did not fail may sit in a collective forever
        return subprocess.CompletedProcess([str(script), *args], codes[failed[0]] if failed else 0, out, err)

    def _wait(self, world: int, timeout: float, script) -> list[int]:
        """Each rank's exit code; once one rank fails, the others get a few seconds to finish."""
        codes: list[int | None] = [None] * world
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for rank in range(world):
                selector.register(self.replies[rank], selectors.EVENT_READ, rank)
            while None in codes:
                left = deadline - time.monotonic()
                if left <= 0 and any(c not in (None, 0) for c in codes):
                    return [1 if c is None else int(c) for c in codes]  # the rest wait on the failed rank
                if left <= 0:
                    self.stop()
                    raise subprocess.TimeoutExpired(str(script), timeout)
                events = selector.select(timeout=min(left, 1.0))
                for key, _ in events:
                    line = key.fileobj.readline()
                    codes[key.data] = int(line) if line else 1  # no line: the rank process died
                    selector.unregister(key.fileobj)
                if any(c not in (None, 0) for c in codes):
                    deadline = min(deadline, time.monotonic() + 10)
                for rank in range(world):
                    if codes[rank] is None and self.ranks[rank].poll() is not None:
                        codes[rank] = 1
        return [int(c) for c in codes]


_POOL = RankPool()


def run(script: str, world: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`script` on `world` ranks of this pytest worker's pool (see the module docstring)."""
    return _POOL.run(script, world, *args, timeout=timeout)


# ---- the rank process ---------------------------------------------------------------------------


class _Exit(BaseException):
    """os._exit inside a job ends the job, not the rank."""

    def __init__(self, code: int):
        self.code = code


def _serve(rank: int, reply_fd: int) -> None:
    import runpy
    import traceback

    from hp.train.worker import die_with

    die_with(os.getppid())  # a pytest worker that is killed takes its ranks with it

    import torch  # noqa: F401  the imports every job shares, paid once
    import torch.distributed as dist
    import transformers  # noqa: F401

    import hp  # noqa: F401

    reply = os.fdopen(reply_fd, "w")
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    for line in sys.stdin:
        job = json.loads(line)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world"]),
                          LOCAL_WORLD_SIZE=str(job["world"]), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(job["port"]), TORCHELASTIC_RUN_ID="pool")
        sys.argv = [job["script"], *job["args"]]
        sys.path[:] = [os.path.dirname(job["script"]), *path]
        os._exit = _raise_exit
        code = 0
        with open(job["out"], "w") as out, open(job["err"], "w") as err:
            saved = _redirect(out, err)
            try:
                runpy.run_path(job["script"], run_name="__main__")
            except _Exit as e:
                code = e.code
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - the job's failure, reported as torchrun would
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                _restore(saved)
        os._exit = _EXIT
        if dist.is_initialized():
            dist.destroy_process_group()
        _reset(environ, cwd, path)
        reply.write(f"{code}\n")
        reply.flush()


_EXIT = os._exit
_RANK_PID = os.getpid()


def _raise_exit(code: int) -> None:
    if os.getpid() != _RANK_PID:  # a process the job forked (a loader, a pool): its own exit is real
        _EXIT(code)
    raise _Exit(code)


def _redirect(out, err) -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    return saved


def _restore(saved: tuple[int, int]) -> None:
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    os.close(saved[0])
    os.close(saved[1])


def _reset(environ: dict[str, str], cwd: str, path: list[str]) -> None:
    import torch

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    torch._dynamo.reset()  # compile counts are per job
    _forget_meshes()


def _forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions: they key on meshes by shape and names, so a later job's
    equal mesh would be handed the redistributions planned on this job's, with this world's process groups
    (a job then fails to resolve a group name that its own world never made)."""
    import torch
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    for clear in (getattr(redistribute, "clear_redistribute_planner_cache", None),
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)):  # the native one
        if clear is not None:
            clear()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))

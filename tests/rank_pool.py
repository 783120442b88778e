"""Gloo ranks for the multi-process tests, forked from one warm process per pytest worker.

Why: starting a rank costs seconds (Python, torch, transformers' model index
and hp imported anew), and a torchrun launch starts an agent and 2-8 of
them. Here one process (the zygote) starts once per pytest worker, lazily on
first use, imports what every job needs, and then only forks: each job gets
`world` fresh ranks, forked in milliseconds, which exit when the job ends.
A fresh fork shares nothing with an earlier job (no process group, no
compiled graph, no DTensor cache), so a job runs as under torchrun, compiled
runs included, and a job that fails or hangs costs only its own ranks.

A job is a script run as torchrun would run it: `RANK`, `LOCAL_RANK`,
`WORLD_SIZE`, `MASTER_ADDR` / `MASTER_PORT` (a fresh port, so each job builds
a fresh gloo world) and `sys.argv` are set, and the script runs as
`__main__`; `HP_POOL_JOB_DIR` names a directory its ranks share, removed when the job ends. Its stdout and
stderr go to files and come back as a
`subprocess.CompletedProcess` (rank 0's output last), so callers check it
exactly as a torchrun result. Once a rank fails the others get 10 seconds
to finish (they may wait in a collective forever), then are killed; so are
all of them past the job's timeout.

The zygote stays single-threaded and never runs a collective or a compiled
graph, so what a fork inherits is imports only. `start` forks plain
processes that run at once and are not waited for (`Started`, read as a
`subprocess.Popen`), each in a directory of its own: the `hp train` launches
whose launcher the tests watch, signal and stop (`train_runs.launch`). A
launch's timeout under torchrun still starts real processes
(`gloo_launch.torchrun`).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import _free_port, clean_env

HERE = Path(__file__).resolve().parent
GRACE = 10  # seconds the other ranks get once one has failed
JOB_DIR_ENV = "HP_POOL_JOB_DIR"  # a directory of the job's own, which its ranks share and which goes with the job


class Zygote:
    """The warm process that forks each job's ranks; it reports their pids, then each one's exit code."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pending = b""  # what the zygote wrote past the last line read
        self.in_flight: _Job | None = None  # a job started and not yet ended

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=clean_env(), cwd=HERE.parent, text=True,
                                     start_new_session=True)
        self.pending = b""

    def run(self, argv: list[str], world: int, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run `python *argv` on `world` fresh ranks, as `torchrun --nproc-per-node world` would; `world` 0: one
        process as a plain `python` command runs, without a launcher's variables."""
        self._ready()
        ranks = max(world, 1)
        with tempfile.TemporaryDirectory(prefix="hp-pool-") as outputs:
            job = {"argv": [str(a) for a in argv], "world": world, "ranks": ranks, "port": _free_port(),
                   "out": outputs}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            codes = self._wait(ranks, timeout, argv)
            out = "".join(Path(f"{outputs}/{r}.out").read_text() for r in reversed(range(ranks)))
            err = "".join(Path(f"{outputs}/{r}.err").read_text() for r in reversed(range(ranks)))
        failed = [r for r, code in enumerate(codes) if code != 0]
        return subprocess.CompletedProcess(["python", *argv], codes[failed[0]] if failed else 0, out, err)

    def start(self, argvs: list[list[str]], cwds: list[str]) -> list[Started]:
        """`python *argv` for each of `argvs` at once, each a plain process in its directory of `cwds`, not waited
        for: a `Started` each, to poll, signal and read as `subprocess.Popen`'s."""
        self._ready()
        job = {"argvs": [[str(a) for a in argv] for argv in argvs], "cwds": [str(c) for c in cwds], "world": 0,
               "ranks": len(argvs), "port": _free_port(), "out": tempfile.mkdtemp(prefix="hp-pool-")}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        started = self._line(time.monotonic() + 600)
        if started is None:
            raise RuntimeError("the test zygote started no process in 600 s")
        self.in_flight = _Job(self, [int(p) for p in started.split()], job["out"])
        return [Started(self.in_flight, rank) for rank in range(len(argvs))]

    def _ready(self) -> None:
        """A live zygote with no job under way: one left running (a test that failed before it waited) is ended."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
            self.in_flight = None
        if self.in_flight is not None:
            self.in_flight.end()

    def _wait(self, ranks: int, timeout: float, script) -> list[int]:
        """Each rank's exit code; once one rank fails, the others get `GRACE` seconds to finish."""
        started = self._line(time.monotonic() + 600)  # at first, after the zygote's imports
        if started is None:
            raise RuntimeError("the test zygote started no ranks in 600 s")
        pids = [int(p) for p in started.split()]
        codes: list[int | None] = [None] * ranks
        deadline = time.monotonic() + timeout
        timed_out = False
        while None in codes:
            line = self._line(deadline)
            if line is None:  # past the deadline: end the job's ranks; the zygote reports each
                timed_out = timed_out or not any(c not in (None, 0) for c in codes)
                _kill(pids)
                deadline = time.monotonic() + 60
                continue
            rank, code = map(int, line.split())
            codes[rank] = code
            if code != 0:
                deadline = min(deadline, time.monotonic() + GRACE)
        if timed_out:
            raise subprocess.TimeoutExpired(str(script), timeout)
        return [int(c) for c in codes]

    def _line(self, deadline: float) -> str | None:
        """The zygote's next reply line, or None past `deadline` (read unbuffered: a selector sees the pipe only)."""
        while b"\n" not in self.pending:
            with selectors.DefaultSelector() as selector:
                selector.register(self.proc.stdout, selectors.EVENT_READ)
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the test zygote died (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()


class _Job:
    """A started job's processes and their exit codes, as the zygote reports them."""

    def __init__(self, zygote: Zygote, pids: list[int], out: str):
        self.zygote, self.pids, self.out = zygote, pids, out
        self.codes: list[int | None] = [None] * len(pids)

    def collect(self, deadline: float) -> None:
        """Read the zygote's reports until `deadline` (now: what it has written), or until every process ended."""
        while None in self.codes:
            line = self.zygote._line(deadline)
            if line is None:
                return
            rank, code = map(int, line.split())
            self.codes[rank] = code
        if self.zygote.in_flight is self:
            self.zygote.in_flight = None

    def end(self) -> None:
        _kill([pid for pid, code in zip(self.pids, self.codes) if code is None])
        self.collect(time.monotonic() + 60)
        shutil.rmtree(self.out, ignore_errors=True)


class Started:
    """One process of a started job, read as a `subprocess.Popen` with text pipes: pid, poll, wait, communicate,
    send_signal; its output comes whole once it has ended."""

    def __init__(self, job: _Job, rank: int):
        self.job, self.rank, self.pid = job, rank, job.pids[rank]

    @property
    def returncode(self) -> int | None:
        return self.job.codes[self.rank]

    def poll(self) -> int | None:
        self.job.collect(time.monotonic())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 3600)
        while self.returncode is None:
            self.job.collect(deadline)
            if self.returncode is None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return tuple(Path(f"{self.job.out}/{self.rank}.{kind}").read_text() for kind in ("out", "err"))

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_ZYGOTE = Zygote()


def run(script: str, world: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`script` on `world` fresh ranks forked by this pytest worker's zygote (see the module docstring)."""
    return _ZYGOTE.run([script, *args], world, timeout=timeout)


def start(argvs: list[list[str]], cwds: list[str]) -> list[Started]:
    """`python *argv` for each of `argvs` at once, forked by this pytest worker's zygote, each in its directory of
    `cwds`; not waited for (`Started`). The next job of the zygote ends any of them still running."""
    return _ZYGOTE.start(argvs, cwds)


def python(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *argv` (a script, `-m module` or `-c code`, then its arguments) as a fresh process would run it,
    forked by the zygote: for a check that needs a process of its own, not a launch."""
    return _ZYGOTE.run(list(argv), 0, timeout=timeout)


# ---- the zygote ------------------------------------------------------------------------------------


def _preload() -> None:
    """What jobs import, paid once: torch and its compiler, hp and its trainer, transformers' index and the zoo's
    families."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import hp  # noqa: F401
    import hp.train.launch  # noqa: F401
    import hp.train.loop  # noqa: F401
    import hp.train.worker  # noqa: F401
    import transformers.optimization  # noqa: F401 - the trainer's schedulers: transformers' trainer utilities, PEFT's
    # what a job's first torch.compile imports (dynamo's backends, AOTAutograd, inductor's passes): 1.3 s a process,
    # which the compile workers' ranks and `hp train`'s torch_compile runs paid each
    import torch._dynamo.backends.common  # noqa: F401
    import torch._inductor.debug  # noqa: F401
    import torch._inductor.pattern_matcher  # noqa: F401
    from hp.models import FAMILIES, MOE_FAMILIES, VL_FAMILIES, tiny_config

    for family in (*FAMILIES, *MOE_FAMILIES, *VL_FAMILIES):  # each family's modeling module, through its Auto class
        config = tiny_config(family)
        auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
        auto._model_mapping[type(config)]  # noqa: B018


def _serve() -> None:
    from hp.train.worker import die_with

    die_with(os.getppid())  # a pytest worker that is killed takes its zygote with it
    zygote = os.getpid()
    _preload()
    gc.freeze()  # what the imports made is never collected: a fork's collections neither walk nor copy it
    gc.set_threshold(20_000, 20, 20)  # as in the pytest workers (conftest.py): fewer young collections
    reply = os.fdopen(os.dup(1), "w")  # the pipe to the pytest worker; a stray print goes to stderr, not into it
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        pids = [_fork(job, rank, zygote, reply) for rank in range(job["ranks"])]
        reply.write(" ".join(map(str, pids)) + "\n")
        reply.flush()
        ranks = {pid: rank for rank, pid in enumerate(pids)}
        while ranks:
            pid, status = os.wait()
            if pid in ranks:
                reply.write(f"{ranks.pop(pid)} {os.waitstatus_to_exitcode(status)}\n")
                reply.flush()


def _fork(job: dict, rank: int, zygote: int, reply) -> int:
    pid = os.fork()
    if pid:
        return pid
    reply.close()  # the pipe is the zygote's alone: a rank that outlives it must not hold it open
    code = 1
    try:
        code = _rank(job, rank, zygote)
    finally:
        os._exit(code)


def _rank(job: dict, rank: int, zygote: int) -> int:
    """Run the job's command as rank `rank`; its exit code."""
    import traceback

    from hp.train.worker import die_with

    os.setpgid(0, 0)  # a signal meant for the job (a Ctrl-C in the terminal) is not the zygote's
    die_with(zygote)
    if job.get("cwds"):
        os.chdir(job["cwds"][rank])
    os.environ[JOB_DIR_ENV] = job["out"]
    if job["world"]:
        world = str(job["world"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]),
                          TORCHELASTIC_RUN_ID="pool")
    out = os.open(f"{job['out']}/{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(f"{job['out']}/{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdin = open(os.devnull)
    try:
        _main(job["argvs"][rank] if job.get("argvs") else job["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the job's failure, reported as torchrun would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _main(argv: list[str]) -> None:
    """Run `python *argv` in this process: a script, `-m module` or `-c code`."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _serve()

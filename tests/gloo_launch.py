"""Launch a script on N local gloo processes through torch's elastic launcher.

Known upstream problem (torch 2.13 CPU wheel): a process that ran a gloo
all-gather sometimes aborts *at interpreter exit* with "terminate called
without an active exception", after its work is done and printed; about 1 in
10 runs of this five-line script hits it, with no hp involved:

    dist.init_process_group("gloo")
    out = torch.empty(4, 4)
    dist.all_gather_into_tensor(out, torch.ones(2, 4))
    print(out.sum())

So a run counts as clean when it exits 0, or when that exit-time abort is the
only failure: the callers still check every rank's printed result.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

EXIT_ABORT = "terminate called without an active exception"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without a launcher's rank variables, one thread per process."""
    # and without what an `hp train` launched in this process left for its workers
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HP_LAUNCHER_PID",
                                                            "HP_ERRORS")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` workers; past `timeout` seconds the launcher is told to stop, which
    stops its workers (each runs in a session of its own, which killing the launcher alone would
    leave spinning on the machine's cores), and TimeoutExpired is raised."""
    # --standalone: the launcher's store binds a port the system picks, so launches running side
    # by side (pytest's workers) never race for one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script, *args]
    # files, not pipes: a worker that outlived its launcher would keep a pipe open forever
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=clean_env(), stdout=out, stderr=err, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the elastic agent ends its workers on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err)) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, _read(out), _read(err))


def _read(file) -> str:
    file.seek(0)
    return file.read()


def assert_finished(run: subprocess.CompletedProcess) -> None:
    """Exit 0, or only the known exit-time abort (see the module docstring)."""
    if run.returncode == 0:
        return
    worker_raised = re.search(r"\[rank\d+\]: Traceback", run.stderr) is not None
    assert EXIT_ABORT in run.stderr and not worker_raised, run.stdout[-3000:] + run.stderr[-3000:]

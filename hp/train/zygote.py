"""One warm process per node that forks `hp train`'s workers: the imports paid once, not once per worker and restart.

A worker that starts as a fresh Python spends seconds importing torch, hp and
transformers before it does anything, and every worker on the node pays it
again, as does every restart of the group. So each node's launcher has one
process, the zygote, that holds what a worker imports (the trainer and the
config's model family) and from then on only forks, as multiprocessing's
forkserver does. On CPU it is the launcher itself, forked before its checks
while it has only imported (no threads, helper processes or tensor ops yet);
on an accelerator, whose driver the checks ask for devices (a process that
has done so cannot be forked safely), a fresh `python -m hp.train.zygote
SOCKET CONFIG [key=value ...]` started after them.

torch's elastic agent still owns the workers' lives. For each rank it starts
a stand-in (`hp/train/stand_in.py`: the standard library only, so it starts
in milliseconds) that hands the zygote its arguments, environment (the
agent's `RANK`, `WORLD_SIZE`, `MASTER_PORT`, ...), working directory and
standard streams over a Unix socket in the launcher's private directory.
The agent watches, signals and restarts the stand-in as it would the
worker: the stand-in passes every signal on to its worker and ends as the
worker ended, with its exit code or killed by the same signal.

The zygote never runs a tensor op or touches a device: a process that has
used a thread pool (OpenMP) or an accelerator's driver cannot be forked
safely, one that has only imported can. A forked worker gets a session of
its own (as the agent gives each worker), the stand-in's environment,
directory and streams, the thread count `OMP_NUM_THREADS` sets, and the
process name `hp rank N` (`ps`, `top`); it dies with the zygote, the zygote
with the launcher, and a stand-in that dies (the agent's last resort,
SIGKILL) takes its worker with it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_in.py")
_HEADER = 8  # bytes of a request's length, before its JSON
_SOCKET_PATH_MAX = 100  # a Unix socket's path must fit in sun_path (108 bytes on Linux)


@contextlib.contextmanager
def started(private: str, argv: Sequence[str], *, fork: bool = False) -> Iterator[list[str]]:
    """A zygote for `hp train *argv` while the block runs; yields the agent's worker command (after `python`).

    `fork`: the zygote is this process forked (what it imported is the zygote's at once), which is safe only
    while this process has only imported: no tensor op run on several threads, no accelerator's driver asked,
    no threads or helper processes started (multiprocessing's), as a CPU run's launcher before its checks;
    otherwise a fresh `python -m hp.train.zygote`, which binds its socket before its imports, so
    that the stand-ins connect at once and wait. The zygote is stopped when the block ends (its workers with it).
    """
    path = _socket_path(private)
    stop = _forked(path, argv) if fork else _spawned(path, argv)
    try:
        yield ["-I", STAND_IN, path, *argv]  # -I: the stand-in's directory (hp/train) is not on its sys.path
    finally:
        stop()
        if not path.startswith(private):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _spawned(path: str, argv: Sequence[str]):
    zygote = subprocess.Popen([sys.executable, "-m", "hp.train.zygote", path, *argv], start_new_session=True)

    def stop() -> None:
        zygote.terminate()
        zygote.wait()

    return stop


def _forked(path: str, argv: Sequence[str]):
    sys.stdout.flush()
    sys.stderr.flush()  # what is buffered now must not be written twice
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # held until the child has dropped this process's handlers
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the agent's to pass on
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            os.setsid()
            serve(path, argv)
        finally:
            os._exit(1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)

    return stop


def _socket_path(private: str) -> str:
    path = os.path.join(private, "zygote.sock")
    if len(path) <= _SOCKET_PATH_MAX:
        return path
    return os.path.join(tempfile.mkdtemp(prefix="hp-", dir="/tmp"), "zygote.sock")  # a long TMPDIR


# ---- the zygote ------------------------------------------------------------------------------------


def serve(path: str, argv: Sequence[str]) -> None:
    """Fork a worker for each stand-in that connects to `path`, tell it the worker's pid, then how it ended."""
    from hp.train.worker import die_with

    die_with(os.getppid())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _preload(argv)
    gc.freeze()  # what the imports made is never collected: a worker's collections neither walk nor copy it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a worker's end wakes the selector through wake_r
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the agent's to pass on, through the stand-ins
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    workers: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    own = [listener.fileno(), wake_r, wake_w, selector.fileno()]
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                pid = _fork(connection, [*own, *(c.fileno() for c in workers.values())])
                if pid:
                    workers[pid] = connection
                    selector.register(connection, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            else:  # a stand-in's end: it is gone (killed), so its worker goes too
                selector.unregister(key.fileobj)
                _kill_group(key.data)
        _report_ended(workers, selector)


def _preload(argv: Sequence[str]) -> None:
    """Import what a worker imports: the trainer, transformers' schedulers and the config's model family."""
    # an availability check during the imports asks NVML, which leaves the driver uninitialized for the forks
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import transformers.optimization  # noqa: F401 - the trainer's schedulers

    import hp.train.loop  # noqa: F401
    import hp.train.worker  # noqa: F401
    from hp.train.config import load_config
    from hp.train.data.embedded import model_config
    from hp.train.model import model_class

    try:
        # any vocabulary: only the config's class is wanted, to import its family's modeling module
        hf = model_config(load_config(argv[0], list(argv[1:])).model_name_or_path, vocab_size=512)
        model_class(hf)._model_mapping[type(hf)]  # noqa: B018 - imports the family's modeling module
    except Exception:  # noqa: BLE001 - a worker meets the same error, and reports it
        pass


def _fork(connection: socket.socket, inherited: list[int]) -> int:
    """Fork a worker for the stand-in at `connection`; its pid (0 when the request was unreadable)."""
    try:
        request, fds = _receive(connection)
    except (OSError, ValueError):
        connection.close()
        return 0
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        connection.sendall(f"{pid}\n".encode())
        return pid
    try:
        os.close(connection.fileno())
        for fd in inherited:
            os.close(fd)
        _become_worker(request, fds, zygote)
    finally:
        os._exit(1)  # the worker leaves through os._exit itself; here only if it could not start


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while len(data) < _HEADER or len(data) < _HEADER + int.from_bytes(data[:_HEADER], "big"):
        more = connection.recv(1 << 16)
        if not more:
            raise ValueError("the stand-in hung up mid-request")
        data += more
    if len(fds) != 3:
        raise ValueError("a request without its three standard streams")
    return json.loads(data[_HEADER:]), fds


def _become_worker(request: dict, fds: list[int], zygote: int) -> None:
    """In the forked child: take the stand-in's session, streams, directory and environment, then run the worker."""
    from hp.train.worker import LAUNCHER_ENV, main

    os.setsid()
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[LAUNCHER_ENV] = str(zygote)  # the worker dies with its parent, this zygote
    _threads()
    sys.argv = ["hp.train.worker", *request["argv"]]
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as a fresh process would buffer its new stdout
    main(request["argv"])


def _threads() -> None:
    """The compute threads `OMP_NUM_THREADS` asks for: the runtime read the zygote's environment when it loaded."""
    import torch

    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        torch.set_num_threads(int(wanted))


def _report_ended(workers: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Tell each ended worker's stand-in how it ended (waitstatus_to_exitcode: negative for a signal)."""
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = workers.pop(pid, None)
        if connection is None:
            continue
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(connection)
        with contextlib.suppress(OSError):
            connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        connection.close()


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)
            return


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])

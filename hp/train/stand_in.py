"""What torch's elastic agent starts for each `hp train` worker: a process that has the zygote fork the worker, then stands in for it.

Run as `python -I stand_in.py SOCKET CONFIG [key=value ...]` (see
`hp.train.zygote`). It imports only the standard library, so it starts in
milliseconds. It hands the zygote at SOCKET its arguments, environment,
working directory and standard streams, learns the worker's pid, passes
every signal the agent sends on to the worker's process group, and ends as
the worker ended: with its exit code, or killed by the same signal, so the
agent (and `hp.train.post_mortem`) see the worker's own ending.
"""

import ctypes
import json
import os
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
CONNECT_S = 120  # how long to wait for the zygote's socket to appear (it binds it as it starts)


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    _die_with_the_agent()
    worker = []  # its pid, once the zygote has forked it
    pending = []  # signals that came before

    def forward(number, frame):
        if worker:
            _signal(worker[0], number)
        else:
            pending.append(number)

    for number in FORWARDED:
        signal.signal(number, forward)
    connection = _connect(path)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    replies = connection.makefile("r")
    pid = replies.readline()
    if not pid:
        _end(1, "the zygote closed the connection before forking the worker")
    worker.append(int(pid))
    for number in pending:
        _signal(worker[0], number)
    ended = replies.readline()
    _end(int(ended) if ended else 1, "" if ended else "the zygote ended before its worker did")


def _die_with_the_agent() -> None:
    """Have the kernel SIGKILL this process when the agent (its parent) ends, as a worker would die (Linux)."""
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it ended before the signal was set
            os._exit(1)


def _connect(path: str) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            connection.connect(path)
            return connection
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                _end(1, f"no zygote answered at {path} within {CONNECT_S} s")
            time.sleep(0.01)


def _signal(pid: int, number: int) -> None:
    """`number` to the worker's process group (its own loader processes too); to the worker alone until it has one."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, number)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _end(code: int, why: str) -> None:
    """Leave as the worker left: its exit code, or dead of its signal (a negative code)."""
    if why:
        print(f"hp train: {why}", file=sys.stderr, flush=True)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process by default: as a shell reports it
    os._exit(code)


if __name__ == "__main__":
    main()

"""What the multi-rank benchmarks share: printing from rank 0, gathering values, launching, profile buckets.

`llama_step.py`, `moe.py`, `overhead.py` and `mpmd.py` each launch their own
script on real gloo ranks (`run_ranks`) and read JSON records back from the
shared pipe; the helpers here are the parts of that which do not depend on
the model being measured. Run as
scripts, the benchmarks import this module from their own folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

Emit = Callable[[dict], None]  # prints one record (on rank 0)
DONE = "worker_done"  # rank 0's last line, once every rank is past its last collective


def emitter(rank: int) -> Emit:
    """Print a record as one JSON line, from rank 0 only (the others compute along)."""

    def emit(record: dict) -> None:
        if rank == 0:
            print(json.dumps(record), flush=True)

    return emit


def gathered(value: object) -> list:
    """`value` from every rank, in rank order."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(value: float) -> float:
    """`value` (a time, an error) at its largest over the ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_record(line: str) -> dict | None:
    """The JSON record in a line of the ranks' output, or None.

    Both ranks share the pipe, and the profiler's C++ log lines may lack their newline, so a
    record can arrive glued after one: parse from the first brace.
    """
    start = line.find("{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start:])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def relay(lines: Iterable[str]) -> tuple[list[dict], bool]:
    """Print the workers' records as they come; (the records, whether rank 0 said it was done).

    torch's gloo sometimes aborts at interpreter exit after all work is done (see
    tests/gloo_launch.py): a launcher tolerates a failed exit only when `done`.
    """
    records: list[dict] = []
    done = False
    for line in lines:
        record = as_record(line)
        if record is None:  # torchrun's banner, library chatter: not results
            sys.stderr.write(line)
        elif DONE in record:
            done = True
        else:
            records.append(record)
            print(json.dumps(record), flush=True)
    return records, done


def run_ranks(script: str, ranks: int, argv: list[str], name: str,
              env: Mapping[str, str] | None = None) -> tuple[list[dict], int]:
    """Run `script --worker` on `ranks` gloo workers (torchrun, one core each); (their records, the exit code).

    The records are relayed as they come (stderr is inherited, so warnings and failures show as they happen).
    torch's gloo sometimes aborts at interpreter exit after all work is done (see tests/gloo_launch.py): a
    failed exit is tolerated only when rank 0 saw every rank reach the final barrier; else SystemExit names
    the benchmark.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(script), *argv, "--worker"]
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environ["OMP_NUM_THREADS"] = "1"  # one core per rank: the ranks must not fight over threads
    environ.update(env or {})
    proc = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, text=True)
    records, done = relay(proc.stdout)
    code = proc.wait()
    if code != 0 and not done:
        raise SystemExit(f"{name}: the {ranks}-rank workers failed (exit {code}) before finishing")
    return records, code


def bind_to_cores(local_rank: int, local_ranks: int) -> set[int]:
    """Bind this process (and the threads it starts from now on: gloo's) to its own share of the cores.

    Unbound, the ranks' compute threads and gloo's threads migrate between the cores and take
    turns on each other's, so the ranks drift apart and wait for one another at every collective.
    Call it before the process group starts its threads.
    """
    cores = sorted(os.sched_getaffinity(0))
    share = max(len(cores) // local_ranks, 1)
    first = (local_rank * share) % len(cores)
    mine = set(cores[first:first + share])
    os.sched_setaffinity(0, mine)
    return mine


def adamw(params: Iterable) -> torch.optim.Optimizer:
    # One optimizer setting for every configuration (on CPU AdamW runs its per-tensor loop).
    return torch.optim.AdamW(params, lr=1e-4)


def no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def short(filename: str) -> str:
    """A profiled file's path from its package root on (`torch/distributed/...`, `hp/ops/...`)."""
    parts = filename.replace(os.sep, "/").split("/")
    for root in ("hp", "torch", "transformers"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return parts[-1]


def bucket(filename: str) -> str:
    """The package a profiled function belongs to (cProfile's filename)."""
    import hp

    if filename.startswith(os.path.dirname(hp.__file__)):
        return "hp"
    for part, name in (
        ("torch/distributed/tensor/", "dtensor"), ("torch/distributed/_functional_collectives", "funcol"),
        ("torch/distributed/fsdp/", "fsdp"), ("transformers/", "transformers"), ("torch/optim/", "optim"),
        ("torch/autograd/", "autograd"), ("torch/utils/_pytree", "pytree"), ("torch/nn/", "nn"),
        # C++ called through pybind (a blocking gloo collective) counts as its Python caller's time
        ("torch/_ops.py", "torch_ops (incl. C++ below)"), ("torch/_library/", "torch_ops (incl. C++ below)"),
    ):
        if part in filename:
            return name
    return "C (kernels, collectives)" if filename == "~" else "other python"

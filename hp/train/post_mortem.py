"""How a run of several workers ended, told in one message: which rank, of what, and how to go on.

When one worker dies, its peers fail too, each with a symptom of the death
("Connection closed by peer"), and the first message to reach the user is
usually a peer's. The cause is elsewhere: a rank that ended without
recording a Python error was killed (SIGKILL: the kernel's out-of-memory
killer or a cluster scheduler), crashed in native code (SIGSEGV), or exited
on its own. So the launcher hands everything it knows here: the failures
the workers recorded (`hp.train.errors.record`: the error, the collective
and the call site; a stopped worker's, where it was) and each failed rank's
exit code (negative: the signal that ended it). The message names

- for a collective that timed out, the ranks that waited, the collective
  and where it was called, and the ranks that never joined it (where they
  were), or that every rank waited in a different collective;
- the rank that died of a signal or an exit without a word, with the likely
  cause and the peak memory the run last reported, before any peer's symptom;
- over several nodes, when this node's ranks only saw a peer go, that the
  cause is on another node (whose launcher names it);
- else the lowest rank whose own error is not a symptom of a peer's death;
- and, for a failure during training, the last complete checkpoint and the
  command that resumes from it.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hp.train import errors
from hp.train.report import logged

# What a rank's error says when it is a peer's death it saw, not a failure of its own (gloo, nccl, hccl).
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe",
                 "ECONNRESET", "NCCL communicator was aborted", "peer process has exited")
_CAUSES = {
    "SIGKILL": "what the kernel's out-of-memory killer or a cluster scheduler does",
    "SIGSEGV": "a segmentation fault in native code (a kernel or a library)",
    "SIGBUS": "a bus error, often a shared-memory segment (/dev/shm) that ran full",
    "SIGABRT": "an abort in native code (a failed check in torch or a collective library)",
}


def ending(records: Sequence[Mapping], exit_codes: Mapping[int, int], output_dir: str, command: str, *,
           nodes: int = 1) -> tuple[str, int]:
    """(the one message, the exit status) of a run whose workers failed.

    `records` are the failures the workers recorded (rank, exit_code, message); `exit_codes` each failed
    rank's process exit code (negative: killed by that signal); `command` resumes the run.

    >>> message, status = ending([{"rank": 0, "exit_code": 1, "message": "RuntimeError: Connection closed by peer"}],
    ...                          {0: 1, 1: -9}, "/nonexistent", "hp train run.yaml")
    >>> status, message.split(";")[0]
    (1, "worker rank 1 was killed by SIGKILL (what the kernel's out-of-memory killer or a cluster scheduler does)")
    """
    found = cause(records, exit_codes, output_dir, nodes=nodes)
    # a crash, not bad input; a diverged run's own message names its last good checkpoint
    if found.status == errors.FAILED and found.kind != "TrainingError":
        return f"{found.text}; {_resume(output_dir, command)}", found.status
    return found.text, found.status


@dataclass(frozen=True)
class Cause:
    """Why a round of workers failed: the rank at fault (None: unknown), in words, its exit status and kind."""

    rank: int | None
    text: str
    status: int
    kind: str = ""


def cause(records: Sequence[Mapping], exit_codes: Mapping[int, int], output_dir: str, *, nodes: int = 1) -> Cause:
    """The rank at fault and why, without how to go on (`ending`'s rules); `nodes`: the run's node count (the
    records and exit codes are this node's)."""
    stops = {int(r["rank"]): r for r in records if r.get("kind") == "stopped"}  # where the stopped ranks were
    recorded = {int(r["rank"]): r for r in records if r.get("kind") != "stopped"}
    silent = {rank: code for rank, code in exit_codes.items() if rank not in recorded}
    # the agent stops the survivors of a failure (SIGTERM; a worker leaves on it with 130): effects, not causes
    stopped = {rank for rank, code in silent.items() if code in (-signal.SIGTERM, -signal.SIGINT, errors.INTERRUPTED)}
    own = [r for r in recorded.values() if not any(s in r["message"] for s in PEER_SYMPTOMS)]
    timeouts = [r for r in own if r.get("kind") == "timeout"]
    if timeouts:  # before the signals: a stuck rank that ignored SIGTERM was SIGKILLed by the agent
        return _timed_out(timeouts, exit_codes, {**stops, **recorded}, nodes)
    killed = sorted(rank for rank, code in silent.items() if code < 0 and rank not in stopped)
    exited = sorted(rank for rank in silent if rank not in stopped and rank not in killed)
    if killed or (exited and not own):
        rank = (killed or exited)[0]
        return _silent(rank, silent[rank], exit_codes, output_dir)
    if not own and recorded and nodes > 1:
        first = min(recorded.values(), key=lambda r: r["rank"])
        return Cause(None, f"rank {first['rank']} lost a peer ({first['message']}): a worker on another node ended "
                           "first, and that node's hp train says which and why", errors.FAILED, "peer")
    if own or recorded:
        first = min(own or recorded.values(), key=lambda r: r["rank"])
        where = f"rank {first['rank']}: " if len(exit_codes) > 1 and first["rank"] != 0 else ""
        return Cause(int(first["rank"]), f"{where}{first['message']}", int(first["exit_code"]), first.get("kind", ""))
    if silent:
        rank = min(silent)
        return _silent(rank, silent[rank], exit_codes, output_dir)
    return Cause(None, "the workers failed without saying why; hp train --debug shows more", errors.FAILED)


def _timed_out(timeouts: Sequence[Mapping], exit_codes: Mapping[int, int], known: Mapping[int, Mapping],
               nodes: int) -> Cause:
    """Ranks that waited out ddp_timeout in a collective: which one, called where, and who never joined it."""
    waited = sorted(int(r["rank"]) for r in timeouts)
    first = min(timeouts, key=lambda r: r["rank"])
    text = f"{_ranks(waited)} waited out ddp_timeout in {_doing(first)}"
    absent = sorted(set(exit_codes) - set(waited))
    if absent:
        text += "; " + ", ".join(f"rank {r}{_was(known.get(r))}" for r in absent) + " never joined it"
    elif nodes > 1:
        text += "; the ranks that never joined it are on another node"
    elif len({(r.get("collective"), r.get("where")) for r in timeouts}) > 1:
        text = ("every rank waited out ddp_timeout, in different collectives (" +
                "; ".join(f"rank {r['rank']} in {_doing(r)}" for r in sorted(timeouts, key=lambda r: r["rank"])) +
                "): the ranks called collectives in different orders, or one was held up (a process stopped or "
                "swapped out) after the others had passed its collective")
    else:
        text += "; every rank was in it, so one was held up inside it (a process stopped or swapped out, a link that broke)"
    hint = "a rank that is slow rather than stuck (a first compile, a slow disk or network) needs a larger ddp_timeout"
    return Cause(waited[0], f"{text}; {hint}", errors.FAILED, "timeout")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _doing(record: Mapping) -> str:
    """`all_reduce called at hp/train/clipping.py:38 in clip_gradients`, from what a rank recorded."""
    what = record.get("collective") or "a collective"
    return f"{what} called at {record['where']}" if record.get("where") else what


def _was(record: Mapping | None) -> str:
    """Where a rank that never joined was, when it recorded it (stopped, or failed of its own)."""
    if not record or not record.get("where"):
        return ""
    inside = f"in {record['collective']} " if record.get("collective") else ""
    return f" (it was {inside}at {record['where']})"


def _silent(rank: int, code: int, exit_codes: Mapping[int, int], output_dir: str) -> Cause:
    """A rank that ended without recording an error: of a signal, or an exit code of its own."""
    others = _others(exit_codes, rank)
    text = f"worker rank {rank} {_death(code)}{_memory(output_dir)}" + (f"; {others}" if others else "")
    return Cause(rank, text, errors.FAILED, "signal" if code < 0 else "exit")


def _death(code: int) -> str:
    if code >= 0:
        return f"exited with code {code} without saying why"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    cause = _CAUSES.get(name)
    return f"was killed by {name}" + (f" ({cause})" if cause else "")


def _memory(output_dir: str) -> str:
    """The peak memory and step the run last logged (metrics.jsonl), as words; empty when it logged none."""
    last = next((r for r in reversed(logged(output_dir)) if "peak_memory_bytes" in r), None)
    if last is None:
        return ""
    return f"; its peak memory when step {last['step']} was logged: {last['peak_memory_bytes'] / 2**20:.0f} MiB"


def _others(exit_codes: Mapping[int, int], dead: int) -> str:
    peers = sorted(r for r in exit_codes if r != dead)
    return f"the other ranks stopped when it left ({', '.join(map(str, peers))})" if peers else ""


def _resume(output_dir: str, command: str) -> str:
    from hp.train.checkpoint import latest

    last = latest(output_dir)
    if last is None:
        return "no checkpoint was saved before it: run the same command to start again"
    return f"the last complete checkpoint is {last}; resume with: {command} resume_from_checkpoint=last"


def resume_command(config_path: str, overrides: Sequence[str]) -> str:
    """The `hp train` command of this run, without any resume_from_checkpoint it had.

    >>> resume_command("run.yaml", ["max_steps=10", "resume_from_checkpoint=outputs/x/checkpoint-5"])
    'hp train run.yaml max_steps=10'
    """
    kept = [o for o in overrides if not o.startswith("resume_from_checkpoint=")]
    return shlex.join(["hp", "train", config_path, *kept])

"""Restarts: when a worker dies, the whole group starts again from the last complete checkpoint.

`max_restarts: N` hands torch's elastic agent its own restart count, so
the agent restarts every worker of the group (on every node: the c10d
rendezvous forms again) up to N times. hp adds the two things the agent
does not know:

- **Where to go on from.** A restarted worker (`attempt` > 0) resumes from
  the last complete checkpoint of `output_dir`, the data position included,
  so its losses are an uninterrupted run's step for step; with no
  checkpoint yet, it starts over.
- **What happened.** Before the agent restarts a failed round, the launcher
  works out which rank failed and why (`hp.train.post_mortem.cause`),
  prints it as a note and lists it, with the step the run had logged, in a
  file the workers read (`HP_RESTARTS`); the run's summary carries the list
  (`restarts`: step, rank, cause).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hp.train import errors, post_mortem
from hp.train.config import TrainConfig
from hp.train.report import logged

RESTARTS_ENV = "HP_RESTARTS"  # the file listing this run's restarts so far
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torch's elastic agent in each worker


def restarted() -> bool:
    """Whether this worker belongs to a restarted group.

    >>> restarted()
    False
    """
    return attempt() > 0


@functools.cache
def attempt() -> int:
    """Which start of the group this worker's is (0: the first).

    Counted in the agents' store, one counter per global rank: every start of the group starts each rank
    once, on whatever node, so every rank counts alike. The agent's own restart count is not enough over
    several nodes: a node whose workers were healthy when another node's died restarts them without
    counting it (a membership change), and its workers would start afresh while the others resume.

    >>> attempt()  # not launched by the agent
    0
    """
    store = _agent_store()
    if store is None:
        return int(os.environ.get(RESTART_COUNT_ENV, "0"))
    return store.add(f"hp/starts/rank_{os.environ['RANK']}", 1) - 1


def fresh_store() -> dict:
    """`init_process_group`'s keywords for a restarted worker: the agents' store under a prefix of this
    attempt's. The store lives across restarts, and a rank that read the address a dead rank of the previous
    attempt left there (gloo's full-mesh connect) was refused; empty otherwise (env://).

    >>> fresh_store()
    {}
    """
    store = _agent_store() if restarted() else None
    if store is None:
        return {}
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {"store": dist.PrefixStore(f"hp/attempt_{attempt()}", store), "rank": rank, "world_size": world}


@functools.cache
def _agent_store():
    """The elastic agents' store, when the workers share it (c10d rendezvous); None otherwise."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)


def resume_overrides(output_dir: str) -> list[str]:
    """What a restarted worker adds to its overrides: resume from the last complete checkpoint, else start over.

    >>> resume_overrides("/nonexistent")
    ['resume_from_checkpoint=null', 'overwrite_output_dir=true']
    """
    from hp.train.checkpoint import finished

    if finished(output_dir):  # which one verifies, rank 0 finds out once the group is formed
        return ["resume_from_checkpoint=last"]
    return ["resume_from_checkpoint=null", "overwrite_output_dir=true"]


def so_far() -> dict:
    """The summary's `restarts` entry: the restarts the launcher listed, when there were any.

    >>> so_far()
    {}
    """
    path = os.environ.get(RESTARTS_ENV)
    if not path or not os.path.exists(path):
        return {}
    return {"restarts": json.loads(Path(path).read_text())}


@contextmanager
def told(recorded: str, config: TrainConfig, listing: str) -> Iterator[None]:
    """While the elastic agent runs here: each failed round it is about to restart is noted on stderr and
    listed in `listing` (the workers' `HP_RESTARTS`), and its recorded failures cleared for the next round."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers
    rounds: list[dict] = []

    def monitor(agent, group):
        result = original(agent, group)
        if result.is_failed() and agent._remaining_restarts > 0:
            codes = {int(rank): failure.exitcode for rank, failure in result.failures.items()}
            found = post_mortem.cause(errors.all_recorded(recorded), codes, config.output_dir, nodes=config.nnodes)
            step = _last_step(config.output_dir)
            rounds.append({"step": step, "rank": found.rank, "cause": found.text})
            Path(listing).write_text(json.dumps(rounds))
            for path in Path(recorded).glob("*.json"):
                path.unlink()
            restart = agent._worker_group.spec.max_restarts - agent._remaining_restarts + 1
            print(f"\nhp train: note: {found.text}; restarting the workers from the last complete checkpoint "
                  f"(restart {restart} of {agent._worker_group.spec.max_restarts})", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor
    os.environ[RESTARTS_ENV] = listing
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


def _last_step(output_dir: str) -> int:
    """The last step the run logged in metrics.jsonl (0 when none)."""
    return max([0, *(int(r.get("step", 0)) for r in logged(output_dir))])

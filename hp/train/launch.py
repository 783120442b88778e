"""`hp train CONFIG.yaml [key=value ...]`: check everything, then train here or start the workers.

The config and everything else the launcher can see (`hp.train.preflight`)
are checked in this process first, so a mistake fails in a second with one
message, not in N workers. A one-rank run then trains in this process;
otherwise torch's elastic agent runs here and starts `nproc_per_node`
workers on this node, or joins a multi-node rendezvous, and each worker
re-reads the same config and overrides. The workers are forked from one warm
process, the node's zygote (`hp.train.zygote`), which imports torch, hp and
the model's family once for them all and for every restart.

The run's rendezvous is torch's c10d one, which forms again after a restart
on every node: on one node without `master_port`, on a free port (as
`torchrun --standalone` picks), so two runs on one machine do not collide;
with `master_port`, or over several nodes, at `master_addr:master_port`
(DEFAULT_MASTER_PORT when unset), whose store `node_rank` 0 hosts. The
nodes' places in the world are given in the order they join, so global rank
0 may live on any node; a node's ranks stay consecutive (tensor-parallel
groups within a node).

How the run ends is `hp.train.errors`' business: workers record their
failures there, and the launcher prints one message of what happened
(`hp.train.post_mortem`: the rank that died and of what, before its
peers' symptoms, and how to resume); with `max_restarts` the agent
restarts the group from the last complete checkpoint instead
(`hp.train.restarts`). SIGINT and SIGTERM stop the workers (exit 130), and
the workers die with the launcher even when it is SIGKILLed
(`hp.train.worker.die_with`). The agent's own log is shown only when
debugging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence

from hp.device import available
from hp.train import errors, post_mortem, preflight, restarts, zygote
from hp.train.config import DEFAULT_MASTER_PORT, ConfigError, TrainConfig, load_config


def launch(config_path: str, overrides: Sequence[str] = ()) -> int:
    """Train by `config_path` with `overrides`; returns the exit status (see `hp.train.errors`).

    >>> launch("missing.yaml")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    hp.train.config.schema.ConfigError: ...
    """
    from hp.train.data.splits import hand_over

    config = _resolved(load_config(config_path, overrides))
    argv = [str(config_path), *overrides]
    with tempfile.TemporaryDirectory(prefix="hp-launch-") as private, _forked_zygote(config, private, argv) as early:
        splits = _checked(config)
        os.environ["HP_DEVICE"] = config.device
        hand_over(splits, config, private)  # the data this process tokenized: the workers read them
        if _one_process(config):
            from hp.train.loop import train

            train(config)
            return errors.FINISHED
        command = post_mortem.resume_command(str(config_path), list(overrides))
        return _start_workers(config, argv, private, command, early)


@contextlib.contextmanager
def _forked_zygote(config: TrainConfig, private: str, argv: list[str]) -> Iterator[list[str] | None]:
    """On CPU, the node's zygote forked from this process before its checks, while it has only imported: the
    stand-ins' command, or None where the zygote starts later as a fresh process (an accelerator: the checks
    ask its driver for the devices, and a process that has done so cannot be forked safely)."""
    device = available() if config.device == "auto" else config.device  # a device named: no driver asked
    if _one_process(config) or device != "cpu":
        yield None
        return
    with zygote.started(private, argv, fork=True) as command:
        yield command


def _one_process(config: TrainConfig) -> bool:
    return config.nnodes == 1 and config.nproc_per_node == 1


def checked(config_path: str, overrides: Sequence[str] = ()) -> tuple[TrainConfig, tuple]:
    """The config and its data's splits (tokenized), checked as the launcher checks them before any worker
    starts, its notes printed; `hp.train.data.splits.hand_over` gives the splits to the workers."""
    config = _resolved(load_config(config_path, overrides))
    return config, _checked(config)


def _resolved(config: TrainConfig) -> TrainConfig:
    """`config`, unless its `parallel: auto` is still to be chosen: the search sits above the trainer, so the hp
    train command resolves it before the launch (`hp.plan.auto.resolve` gives the overrides to launch with)."""
    if config.parallel_auto:
        raise ConfigError("parallel = 'auto' is chosen by the hp train command before the launch "
                          "(hp.plan.auto.resolve gives the overrides to launch with)")
    return config


def _checked(config: TrainConfig) -> tuple:
    splits = preflight.check(config)
    for note in config.notes:
        print(f"hp train: note: {note}", file=sys.stderr)
    return splits


def _start_workers(config: TrainConfig, argv: list[str], private: str, resume: str, forked: list[str] | None) -> int:
    """Run the elastic agent here over workers of `hp train *argv` that this node's zygote forks (`forked`: the
    command of the stand-ins of a zygote already forked); their outcome as an exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from hp.train.worker import LAUNCHER_ENV

    if not errors.debugging():
        _quiet_agent()
    _cheap_event_names()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: workers share this node's cores
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    print(f"hp train: starting {config.nproc_per_node} workers on this node ({config.world_size} in all)",
          file=sys.stderr, flush=True)
    recorded = os.path.join(private, "errors")
    os.mkdir(recorded)
    os.environ[errors.ERRORS_ENV] = recorded
    try:
        with restarts.told(recorded, config, os.path.join(private, "restarts.json")), \
                (contextlib.nullcontext(forked) if forked else zygote.started(private, argv)) as command:
            elastic_launch(launch_config(config), sys.executable)(*command)
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as failed:
        return _report_workers(recorded, failed, config, resume)
    return errors.FINISHED


def launch_config(config: TrainConfig):
    """The elastic agent's configuration for `config`'s nodes, workers and rendezvous."""
    from torch.distributed.launcher.api import LaunchConfig

    shared = {"min_nodes": config.nnodes, "max_nodes": config.nnodes, "nproc_per_node": config.nproc_per_node,
              "max_restarts": config.max_restarts, "start_method": "spawn"}
    if config.nnodes == 1 and config.master_port is None:
        return LaunchConfig(**shared, rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()))
    port = config.master_port or DEFAULT_MASTER_PORT
    # node_rank 0 hosts the rendezvous's store (its address may not be this host's name: a container, NAT)
    return LaunchConfig(**shared, rdzv_backend="c10d", rdzv_endpoint=f"{config.master_addr}:{port}",
                        rdzv_configs={"is_host": config.node_rank == 0}, run_id=f"hp-train-{port}")


def _report_workers(recorded: str, failed, config: TrainConfig, command: str) -> int:
    """Print how the run ended (`hp.train.post_mortem`): the rank that died and of what, else the first rank's
    own error; how to resume."""
    codes = {int(rank): failure.exitcode for rank, failure in failed.failures.items()}
    text, status = post_mortem.ending(errors.all_recorded(recorded), codes, config.output_dir, command,
                                      nodes=config.nnodes)
    print(f"hp train: {text}", file=sys.stderr, flush=True)
    return status


def _cheap_event_names() -> None:
    """torch's rendezvous names each of its events by its caller through `inspect.stack()`, which reads the
    source of every frame and scans every loaded module for each: seconds per launch in a process that has
    checked the model (transformers imported). The caller's frame gives the same name at once."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # frame 0 is this function, as inspect.stack()[0]
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = method_name


def _quiet_agent() -> None:
    """Keep the elastic agent's log (startup notes, shutdown warnings, failure banners) off the console."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False

"""`hp train CONFIG.yaml [key=value ...]`: validate, then run here or spawn the workers.

The config is validated in this process before anything starts, so a bad key
fails in a second with a message, not in N workers. A one-rank run trains in
this process; otherwise torch's elastic launcher (`torch.distributed.run`)
starts `nproc_per_node` workers on this node, or joins a multi-node
rendezvous (`nnodes`, `node_rank`, `master_addr`, `master_port`), and each
worker re-reads the same config and overrides.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from hp.train.config import ConfigError, TrainConfig, load_config


def launch(config_path: str, overrides: Sequence[str] = ()) -> int:
    """Train by `config_path` with `overrides`; returns the exit status.

    >>> launch("missing.yaml")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    hp.train.config.ConfigError: ...
    """
    config = load_config(config_path, overrides)
    _preflight(config)
    env = {**os.environ, "HP_DEVICE": config.device}
    if config.nnodes == 1 and config.nproc_per_node == 1:
        os.environ["HP_DEVICE"] = config.device
        from hp.train.loop import train

        train(config)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args(config)]
    command += ["-m", "hp.train.worker", config_path, *overrides]
    return subprocess.run(command, env=env).returncode


def _preflight(config: TrainConfig) -> None:
    """Checks that need the filesystem, the model's config and its tokenizer, still before any worker starts."""
    from hp.device import available
    from hp.train.checkpoint import require_complete
    from hp.train.model import check_fits, model_config
    from hp.train.tokenizer import load_tokenizer

    found = available()
    if config.device not in ("auto", "cpu") and found != config.device:
        raise ConfigError(f"device = {config.device!r} is not available on this machine (found: {found})")
    out = config.output_dir
    if os.path.isdir(out) and os.listdir(out) and not (config.overwrite_output_dir or config.resume_from_checkpoint):
        raise ConfigError(
            f"output_dir = {out!r} already holds a run; set overwrite_output_dir: true to start over "
            "or resume_from_checkpoint: last to continue it"
        )
    resume = config.resume_from_checkpoint
    if resume not in (None, "last"):
        try:
            require_complete(resume)
        except FileNotFoundError as e:
            raise ConfigError(f"resume_from_checkpoint = {resume!r}: {e}") from None
    try:
        tokenizer = load_tokenizer(config.model_name_or_path)
        check_fits(model_config(config.model_name_or_path, tokenizer.vocab_size), config.parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def launcher_args(config: TrainConfig) -> list[str]:
    """torch.distributed.run's arguments for the config's nodes and processes."""
    return [
        f"--nproc-per-node={config.nproc_per_node}", f"--nnodes={config.nnodes}", f"--node-rank={config.node_rank}",
        f"--master-addr={config.master_addr}", f"--master-port={config.master_port}",
    ]

"""One launched worker of `hp train`: read the config, train, leave without gloo's exit-time abort.

torch 2.13's gloo sometimes aborts in its destructors at interpreter exit
("terminate called without an active exception") after a run has finished;
the launcher would then report a failed run. The worker therefore tears the
process group down itself, flushes its output and leaves with `os._exit`.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist


def main(argv: list[str] | None = None) -> None:
    from hp.train.config import load_config
    from hp.train.loop import train

    argv = sys.argv[1:] if argv is None else argv
    try:
        train(load_config(argv[0], argv[1:]))
    except BaseException:
        traceback.print_exc()  # before leaving: os._exit skips the interpreter's own report
        _leave(1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _leave(0)


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()

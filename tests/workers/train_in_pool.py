"""`hp train CONFIG [key=value ...]` on a rank of the test pool: what the launcher checks, then a worker's run.

Rank 0 does the launcher's part (`hp.train.launch.checked`: the preflight
checks and the notes on the config's keys; the data tokenized once and handed
over to every rank), while the other ranks wait for its verdict, since no
worker starts when those checks fail; then every rank runs
`hp.train.worker.main`, the launched worker's own code.
"""

from __future__ import annotations

import os
import sys
import time

from rank_pool import JOB_DIR_ENV

from hp.train import launch, worker
from hp.train.config import load_config
from hp.train.data.splits import SPLITS_ENV, SPLITS_FILE, hand_over


def main() -> None:
    config_path, overrides = sys.argv[1], sys.argv[2:]
    job = os.environ[JOB_DIR_ENV]
    verdict = os.path.join(job, "checked")
    if os.environ["RANK"] == "0":
        try:
            config, splits = launch.checked(config_path, overrides)
            hand_over(splits, config, job)
        except BaseException:
            _tell(verdict, "refused")
            raise
        _tell(verdict, "passed")
    else:
        while not os.path.exists(verdict):
            time.sleep(0.01)
        with open(verdict) as f:
            if f.read() != "passed":
                sys.exit(1)  # the launcher's checks failed: no worker would have started
        config = load_config(config_path, overrides)
        os.environ[SPLITS_ENV] = os.path.join(job, SPLITS_FILE)  # none for images: the worker then reads the data
    os.environ["HP_DEVICE"] = config.device
    worker.main(sys.argv[1:])


def _tell(path: str, verdict: str) -> None:
    with open(path + ".partial", "w") as f:
        f.write(verdict)
    os.replace(path + ".partial", path)  # whole, or not there


if __name__ == "__main__":
    main()

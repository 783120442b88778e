"""`hp train CONFIG [key=value ...]` on a rank of the test pool: what the launcher checks, then a worker's run.

Rank 0 does the launcher's part (`hp.train.launch.checked`: the preflight
checks and the notes on the config's keys);
then every rank runs `hp.train.worker.main`, the launched worker's own code.
"""

from __future__ import annotations

import os
import sys

from hp.train import launch, worker
from hp.train.config import load_config


def main() -> None:
    config_path, overrides = sys.argv[1], sys.argv[2:]
    config = launch.checked(config_path, overrides) if os.environ["RANK"] == "0" else load_config(config_path, overrides)
    os.environ["HP_DEVICE"] = config.device
    worker.main(sys.argv[1:])


if __name__ == "__main__":
    main()

"""`hp train CONFIG [key=value ...]` on a rank of the test pool: what the launcher checks, then a worker's run.

Rank 0 does the launcher's part (`hp.train.preflight` and the notes on the
config's keys, as `hp.train.launch.launch` does before it starts workers);
then every rank runs `hp.train.worker.main`, the launched worker's own code.
"""

from __future__ import annotations

import os
import sys

from hp.train import preflight, worker
from hp.train.config import load_config


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    if os.environ["RANK"] == "0":
        preflight.check(config)
        for note in config.notes:
            print(f"hp train: note: {note}", file=sys.stderr)
    os.environ["HP_DEVICE"] = config.device
    worker.main(sys.argv[1:])


if __name__ == "__main__":
    main()

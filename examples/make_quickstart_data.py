"""Write a quickstart dataset to examples/data/ (the tasks and why they suit: `hp.train.data.quickstart`,
`hp.train.data.quickstart_vl`, `hp.train.data.quickstart_preference`).

    python examples/make_quickstart_data.py      # examples/data/quickstart.json, its dataset_info.json entry
    python examples/make_quickstart_data.py vl   # examples/data/quickstart_vl.json and quickstart_vl/*.png
    python examples/make_quickstart_data.py dpo  # examples/data/quickstart_dpo.json (pairs), quickstart_kto.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hp.train.data import quickstart, quickstart_preference, quickstart_vl

# task: (writer, records by default, what a record is)
TASKS = {"text": (quickstart.write, 2000, "examples"), "vl": (quickstart_vl.write, 200, "pictures"),
         "dpo": (quickstart_preference.write, 2000, "pairs")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", choices=TASKS, default="text")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--num", type=int, help="number of records (default: 2000 examples or pairs, 200 pictures)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write, default, what = TASKS[args.task]
    num = args.num or default
    print(f"wrote {num} {what} to {write(args.out_dir, num, args.seed)}")


if __name__ == "__main__":
    main()

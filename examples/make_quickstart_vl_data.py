"""Write the vision-language quickstart dataset to examples/data/ (the task and why: `hp.train.quickstart_vl_data`).

    python examples/make_quickstart_vl_data.py   # writes examples/data/quickstart_vl.json, quickstart_vl/*.png
                                                 # and its entry in examples/data/dataset_info.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hp.train.quickstart_vl_data import write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--num", type=int, default=200, help="number of pictures and records")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {args.num} records and pictures to {write(args.out_dir, args.num, args.seed)}")


if __name__ == "__main__":
    main()

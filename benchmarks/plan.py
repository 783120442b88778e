"""`hp plan --dry-run` at thousands of ranks: how long laying the largest reference shapes out takes here.

Each line: one model and strategy laid out on a fake world of its size in this process (hp.plan.dry_run), with
rank 0's parameters and the seconds it took. The last line carries the issue's figures that exist so far:
`dry_run_world_max` (the largest world laid out) and `dry_run_s_max` (the slowest dry run, in seconds).

    python benchmarks/plan.py
"""

from __future__ import annotations

import json

from hp.plan import dry_run, reference_config

CASES = [
    ("llama-3.1-405b", {"dp": 512, "tp": 8, "fsdp": True}),
    ("llama-3.1-405b", {"dp": 256, "cp": 2, "tp": 8, "sp": True, "fsdp": True}),
    ("deepseek-v3", {"dp": 512, "ep": 64, "tp": 8, "fsdp": True}),
    ("qwen3-235b-a22b", {"dp": 4096, "ep": 64, "fsdp": True}),
    ("qwen2.5-vl-72b", {"dp": 512, "tp": 8, "fsdp": True}),
]


def main() -> None:
    runs = []
    for name, strategy in CASES:
        run = dry_run(reference_config(name), strategy)
        runs.append(run)
        print(json.dumps({"model": name, "strategy": run.strategy, "world": run.world,
                          "rank_parameters": run.rank_parameters, "seconds": round(run.seconds, 2)}), flush=True)
    print(json.dumps({"dry_run_world_max": max(r.world for r in runs),
                      "dry_run_s_max": round(max(r.seconds for r in runs), 2)}))


if __name__ == "__main__":
    main()

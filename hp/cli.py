"""The `hp` command: `hp explain SCRIPT [ARGS...]` (more subcommands land with training).

`hp explain` runs a script as `python SCRIPT ARGS` would, records every op on
DTensors (layouts in and out, collectives inserted, source line) and prints
the table after the script's own output; `--json` prints it as JSON instead,
and `--communicating` keeps only the ops that communicated.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from hp.explain import Explanation, _Recorder


def _explain(args: argparse.Namespace) -> int:
    sys.argv = [args.script, *args.script_args]
    recorder = _Recorder()
    with recorder:
        runpy.run_path(args.script, run_name="__main__")
    report = Explanation(recorder.records)
    if args.communicating:
        report = Explanation(report.communicating())
    print(report.to_json() if args.json else report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp", description="named-axis layouts on PyTorch DTensor")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="per-op layouts and collectives of a script")
    explain.add_argument("--json", action="store_true", help="print the table as JSON")
    explain.add_argument("--communicating", action="store_true", help="only ops that communicated")
    explain.add_argument("script")
    explain.add_argument("script_args", nargs=argparse.REMAINDER)
    explain.set_defaults(run=_explain)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

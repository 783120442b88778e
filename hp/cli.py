"""The `hp` command: `hp train CONFIG [key=value ...]`, `hp plan CONFIG [key=value ...] --devices N`,
`hp export CHECKPOINT OUT_DIR [--merge]`, `hp explain SCRIPT`.

`hp train` validates a LlamaFactory-style YAML and trains (`hp.train.launch`); it
exits 0 when the run finished, 1 when it failed during training, 2 on bad
input and 130 when interrupted (`hp.train.errors`);
`hp plan` lays the same config's model out at its world size in one process and
prints what rank 0 holds (`hp.plan`); `hp export` writes a checkpoint as HF
safetensors (`hp.train.export`).

`hp explain` runs a script as `python SCRIPT ARGS` would, records every op on
DTensors (layouts in and out, collectives inserted, source line) and prints
the table after the script's own output; `--json` prints it as JSON instead,
and `--communicating` keeps only the ops that communicated.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from typing import Any

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


def _train(args: argparse.Namespace) -> int:
    from hp.plan.auto import resolve
    from hp.train import errors
    from hp.train.launch import launch

    if args.debug:
        os.environ[errors.DEBUG_ENV] = "1"  # the workers inherit it
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops a run as Ctrl-C does
    try:
        return launch(args.config, resolve(args.config, args.overrides))
    except BaseException as error:  # noqa: BLE001 - every way a run ends gets its exit code and one message
        return errors.report(error)


def _export(args: argparse.Namespace) -> int:
    from hp.train import errors
    from hp.train.checkpoint import CheckpointError
    from hp.train.config import ConfigError
    from hp.train.export import export

    try:
        print(export(args.checkpoint, args.out_dir, merge=args.merge))
    except CheckpointError as error:
        return errors.report(ConfigError(str(error)), "hp export")
    except BaseException as error:  # noqa: BLE001
        return errors.report(error, "hp export")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hp.plan import dry_run_config, hf_config_of
    from hp.plan.memory import memory_of
    from hp.plan.step import config_step, fake_step
    from hp.plan.step_time import WorkCount, predict
    from hp.plan.devices import check_nodes, device_of
    from hp.plan.report import render, shortfall
    from hp.train import errors
    from hp.train.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
        devices, per_node, device = _cluster(args, config)
        device = device_of(device) if device else None
        given_as = (f"--devices-per-node {per_node}" if args.devices_per_node is not None
                    else f"cluster.devices_per_node = {per_node}")
        check_nodes(devices or config.parallel.world_size, per_node, given_as)
        hf_config = hf_config_of(config.model_name_or_path)
        if args.search or config.parallel_auto:  # parallel: auto is the search's first candidate that fits
            return _search(config, hf_config, devices or config.parallel.world_size, device, args.json)
        run = dry_run_config(config, devices, hf_config)
        memory = untraced = step_time = None
        short = shortfall(run, device) if device is not None else None  # model states alone: no step could fit
        if not args.dry_run and short is None:
            try:
                step = config_step(config, hf_config)
            except ValueError as reason:  # a step hp plan cannot trace yet: the layout's figures still stand
                untraced = str(reason)
            else:
                with fake_step(hf_config, *step) as traced:  # laid out and run once for its memory and its work
                    counted = WorkCount(traced)
                    memory = memory_of(traced, device.backend if device is not None else None, inside=counted)
            short = shortfall(run, device, memory) if device is not None else None
            if memory is not None and device is not None and short is None:  # a step that fits: how long it takes
                step_time = predict(counted.work, device)
        print(render(config.model_name_or_path, run, device=device, memory=memory, untraced=untraced,
                     step_time=step_time, as_json=args.json))
        if short:
            return errors.report(ConfigError(short), "hp plan")
    except ValueError as error:  # a config, model name or strategy that cannot be planned: bad input
        return errors.report(error if isinstance(error, ConfigError) else ConfigError(str(error)), "hp plan")
    except BaseException as error:  # noqa: BLE001
        return errors.report(error, "hp plan")
    return 0


def _search(config, hf_config, world: int, device, as_json: bool) -> int:
    """`hp plan --search`: the candidates for `world` ranks, fastest first on `device`."""
    from hp.plan.report import render_search, search_shortfall
    from hp.plan.search import search_config
    from hp.train.config import ConfigError

    if device is None:
        raise ConfigError("hp plan --search prices each candidate's step on a device: name one with --device "
                          "(or cluster.device)")
    ranked = search_config(config, hf_config, world, device)
    print(render_search(config.model_name_or_path, world, device, ranked, as_json))
    short = search_shortfall(world, device, ranked)
    if short:
        raise ConfigError(short)
    return 0


def _cluster(args: argparse.Namespace, config) -> tuple[int | None, int | None, Any]:
    """(devices, devices per node, device): each flag given, else the config's `cluster:` section's."""
    from hp.train.config.schema import Cluster

    section = config.cluster or Cluster()
    return tuple(flag if flag is not None else getattr(section, key)
                 for flag, key in ((args.devices, "devices"), (args.devices_per_node, "devices_per_node"),
                                   (args.device, "device")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp", description="named-axis layouts on PyTorch DTensor")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train from a LlamaFactory-style YAML config")
    train.add_argument("--debug", action="store_true", help="show tracebacks and the launcher's log (or HP_DEBUG=1)")
    train.add_argument("config", help="YAML file, e.g. examples/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tp=2 max_steps=10")
    train.set_defaults(run=_train)
    plan = commands.add_parser("plan", help="lay a config's model out at its world size, in one process")
    plan.add_argument("config", help="the YAML file hp train takes")
    plan.add_argument("overrides", nargs="*", help="key=value overrides, as hp train takes them")
    plan.add_argument("--devices", type=int, help="the world to plan for (the config's parallel degrees multiply to it; "
                      "else cluster.devices)")
    plan.add_argument("--dry-run", action="store_true", help="only lay the model out and check the strategy (no step "
                      "traced)")
    plan.add_argument("--device", help="a device profile (h100-80g, h200-141g, a100-80g, 910b-64g, or cpu, measured "
                      "here): whether rank 0's model states and step fit its memory")
    plan.add_argument("--devices-per-node", type=int, help="devices per node (they must fill whole nodes)")
    plan.add_argument("--search", action="store_true", help="trace and time every dp, FSDP, tp + sp, cp and recompute "
                      "split of the world (needs --device), fastest first")
    plan.add_argument("--json", action="store_true", help="print one JSON line")
    plan.set_defaults(run=_plan)
    export = commands.add_parser("export", help="write a training checkpoint as HF safetensors")
    export.add_argument("checkpoint", help="a checkpoint-N directory of an hp train run")
    export.add_argument("out_dir")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run: fold the adapters into their weights and write a plain HF model")
    export.set_defaults(run=_export)
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

"""`parallel: auto`: hp train takes the fastest split `hp plan --search` finds for the ranks it launches.

Why here: the choice needs the search (`hp.plan.search`), which traces each
candidate's step by the code a run uses, and the search sits above the
trainer; so the `hp train` command resolves `parallel: auto` before the
launch, and hands the launcher (and through it every worker, and every
restart) the chosen strategy as one override, `parallel={...}`: the workers
never search, and all of them run the same split.

The device the candidates are priced on is `cluster.device` when the config
names one (a profile or its figures), else this machine's
(`hp.plan.devices.local_profile`: an accelerator's profile by the name its
driver reports; a CPU measured on two forked gloo processes, about 10 s).
The world is `nproc_per_node` times `nnodes`. Candidates are the search's:
dp (plain or FSDP), tp with sp, cp ring and Ulysses, each with recompute on
and off (off only, under `disable_gradient_checkpointing: true`). The
choice, and why, is printed before the launch; when nothing fits, one
message names the smallest shortfall.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from hp.plan.devices import GIB, DeviceProfile, device_of, local_profile
from hp.plan.dry_run import describe, hf_config_of
from hp.plan.forked import forked
from hp.plan.report import search_shortfall
from hp.plan.search import Candidate, search_config, strategies


def resolve(config_path: str, overrides: Sequence[str] = ()) -> list[str]:
    """`overrides`, with the strategy `parallel: auto` chooses appended as `parallel={...}` when the config says
    so (and why printed to stderr); unchanged otherwise.

    >>> resolve("examples/quickstart.yaml", ["max_steps=1"])  # its parallel section names the degrees
    ['max_steps=1']
    """
    from hp.device import available
    from hp.train.config import ConfigError, load_config

    config = load_config(config_path, overrides)
    if not config.parallel_auto:
        return list(overrides)
    kind = available() if config.device == "auto" else config.device
    try:
        chosen, why = _in_a_child(config, kind)
    except ValueError as error:  # a model or stage hp plan cannot trace yet, an unknown device: bad input
        raise error if isinstance(error, ConfigError) else ConfigError(f"parallel = 'auto': {error}") from None
    if chosen is None:
        raise ConfigError(why)
    print(why, file=sys.stderr, flush=True)
    return [*overrides, f"parallel={json.dumps(chosen)}"]


def _in_a_child(config, kind: str) -> tuple[dict | None, str]:
    """`choose` on this machine's device, in a process forked for it: the search lays models out on a fake world,
    which must not outlive it here (the launcher forks its workers' zygote from this process on a CPU), and an
    accelerator's driver is asked in the child only."""
    return forked(_choose_on, config, kind, what="parallel: auto's search")


def _choose_on(rank: int, ranks: int, config, kind: str) -> tuple[dict | None, str]:
    device = _device(config.cluster.device if config.cluster else None, kind, config.nproc_per_node)
    return choose(config, device)


def choose(config, device: DeviceProfile) -> tuple[dict | None, str]:
    """The strategy `parallel: auto` takes for `config` (a `TrainConfig`) on its launched ranks of `device`, and the
    line saying why; None and the smallest shortfall when no candidate fits.

    >>> from hp.train.config import validate
    >>> from hp.plan.devices import PROFILES
    >>> config = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o", "cutoff_len": 16,
    ...                    "parallel": "auto", "nproc_per_node": 1})
    >>> choose(config, PROFILES["h100-80g"])[0]  # one rank: with recompute or without, and it fits without
    {'recompute': False}
    """
    world = config.world_size
    among = [s for s in strategies(world) if not (config.disable_gradient_checkpointing and s.get("recompute"))]
    ranked = search_config(config, hf_config_of(config.model_name_or_path), world, device, among=among)
    runs = [c for c in ranked if c.runs]
    if not runs:
        return None, search_shortfall(world, device, ranked)
    best = runs[0]
    return {**best.strategy, "recompute": bool(best.strategy.get("recompute"))}, _why(best, runs, ranked, world,
                                                                                      device)


def _why(best: Candidate, runs: list[Candidate], ranked: list[Candidate], world: int, device: DeviceProfile) -> str:
    """One line: the choice, its predicted step and peak, and how far ahead of the next candidate it is."""
    line = (f"hp train: parallel: auto takes {describe(best.strategy)} on {world} ranks of {device.name}: the fastest "
            f"of the {len(runs)} of {len(ranked)} candidates that fit (hp plan --search), its step "
            f"{best.time.total * 1e3:.1f} ms predicted, {best.tokens_per_s:.0f} tokens/s, peak "
            f"{best.memory.peak / GIB:.2f} of {device.memory_bytes / GIB:.2f} GiB")
    if len(runs) > 1:
        line += f"; next, {describe(runs[1].strategy)}, {runs[1].time.total / best.time.total:.2f}x its step"
    return line


def _device(named, kind: str, ranks: int) -> DeviceProfile:
    """`cluster.device` (a profile's name or its figures) when given, else this machine's device (`cpu` measured as
    the workers run: on processes of their own)."""
    if named is None or named == "cpu":
        return local_profile("cpu" if named else kind, ranks)
    return device_of(named)

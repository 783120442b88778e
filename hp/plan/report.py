"""What `hp plan` prints: a dry run as a few lines for the terminal, or as one JSON line for tools."""

from __future__ import annotations

import json

from hp.plan.devices import GIB, DeviceProfile
from hp.plan.dry_run import DryRun, describe
from hp.plan.memory import StepMemory
from hp.plan.search import Candidate
from hp.plan.step_time import StepTime


def shortfall(run: DryRun, device: DeviceProfile, memory: StepMemory | None = None) -> str | None:
    """Why the run cannot fit `device`: rank 0's model states alone exceed its memory, or its step's peak
    (`memory`, when traced) does; with what would make it fit. None when it fits.

    >>> from hp.plan.devices import profile
    >>> print(shortfall(DryRun(8, "dp=8", 8_000_000_000, 8_000_000_000, 8_000_000_000, (), 0.1), profile("h100-80g")))
    rank 0's model states alone need 119.21 GiB, 39.56 GiB more than h100-80g's 79.65 GiB: shard them with FSDP (parallel.fsdp: true) or over more ranks, split the model (tp, pp), train LoRA adapters, or offload the optimizer states
    """
    need = sum(run.state_bytes.values())
    if need <= device.memory_bytes:
        if memory is None or memory.peak <= device.memory_bytes:
            return None
        return (f"rank 0's step peaks at {memory.peak / GIB:.2f} GiB, {(memory.peak - device.memory_bytes) / GIB:.2f} "
                f"GiB more than {device.name}'s {device.memory_bytes / GIB:.2f} GiB (activations "
                f"{memory.activations / GIB:.2f} GiB, temporaries {memory.temporaries / GIB:.2f} GiB): recompute the "
                "blocks (parallel.recompute: true), split the sequence (sp, cp), lower per_device_train_batch_size "
                "or cutoff_len, or offload")
    return (f"rank 0's model states alone need {need / GIB:.2f} GiB, {(need - device.memory_bytes) / GIB:.2f} GiB "
            f"more than {device.name}'s {device.memory_bytes / GIB:.2f} GiB: shard them with FSDP (parallel.fsdp: "
            "true) or over more ranks, split the model (tp, pp), train LoRA adapters, or offload the optimizer states")


def search_shortfall(world: int, device: DeviceProfile, ranked: list[Candidate]) -> str | None:
    """Why no candidate of `hp plan --search` runs: the smallest peak over the device's memory, and what would make
    it fit; else the first candidate's reason (every split refused by its shapes). None when one runs.

    >>> from hp.plan.devices import PROFILES
    >>> big = StepMemory(0, 0, 0, 0, 0, 0, 0, 0, 90 * GIB, 0)
    >>> print(search_shortfall(8, PROFILES["h100-80g"], [Candidate({"dp": 8}, big, refused="over")]))
    no candidate runs on 8 ranks of h100-80g: peaks at 90.00 GiB at the least (dp=8), 10.35 GiB over h100-80g's \
79.65 GiB: plan more devices, lower per_device_train_batch_size or cutoff_len, or offload
    """
    if any(c.runs for c in ranked):
        return None
    traced = [c for c in ranked if c.memory is not None]
    if not traced:
        return f"no candidate runs on {world} ranks of {device.name}: {ranked[0].refused.splitlines()[0]}"
    least = min(traced, key=lambda c: c.memory.peak)
    return (f"no candidate runs on {world} ranks of {device.name}: peaks at {least.memory.peak / GIB:.2f} GiB at the "
            f"least ({describe(least.strategy)}), {(least.memory.peak - device.memory_bytes) / GIB:.2f} GiB over "
            f"{device.name}'s {device.memory_bytes / GIB:.2f} GiB: plan more devices, lower "
            "per_device_train_batch_size or cutoff_len, or offload")


def render(name: str, run: DryRun, *, device: DeviceProfile | None = None, memory: StepMemory | None = None,
           untraced: str | None = None, step_time: StepTime | None = None, as_json: bool = False) -> str:
    """The dry run of model `name` as text, or as JSON with the model's name (and `device`'s memory) added; with
    rank 0's traced step (`memory`) and its time on `device` (`step_time`), or why it was not traced (`untraced`).

    >>> print(render("m", DryRun(8, "dp=8 fsdp", 8_000_000_000, 1_000_000_000, 1_000_000_000, (), 0.5)))
    hp plan: m, dp=8 fsdp on 8 ranks (laid out in 0.5 s)
      parameters: 8.00 B in all, 1.00 B on rank 0
      rank 0's model states: parameters 3.73 GiB, gradients 3.73 GiB, optimizer states 7.45 GiB (14.90 GiB)
      every split divides evenly
    """
    states = run.state_bytes
    if as_json:
        held = {} if device is None else {"device": device.name, "device_memory_bytes": device.memory_bytes,
                                          "model_states_share": round(sum(states.values()) / device.memory_bytes, 4)}
        if device is not None and memory is not None:
            held["peak_share"] = round(memory.peak / device.memory_bytes, 4)
        step = {"step_memory": memory.to_dict()} if memory is not None else {"untraced": untraced} if untraced else {}
        if step_time is not None:
            step["step_time"] = step_time.to_dict()
        return json.dumps({"model": name, **run.to_dict(), **held, **step})
    parts = ", ".join(f"{kind.replace('_', ' ')} {size / GIB:.2f} GiB" for kind, size in states.items())
    lines = [f"hp plan: {name}, {run.strategy} on {run.world} ranks (laid out in {run.seconds:.1f} s)",
             f"  parameters: {_count(run.parameters)} in all, {_count(run.rank_parameters)} on rank 0",
             f"  rank 0's model states: {parts} ({sum(states.values()) / GIB:.2f} GiB)"]
    if run.uneven:
        lines.append("  splits that do not divide (FSDP pads them: rank 0 holds the larger piece):")
        lines.extend(f"    {split}" for split in run.uneven)
    else:
        lines.append("  every split divides evenly")
    if memory is not None:
        kinds = ", ".join(f"{kind.replace('_', ' ')} {getattr(memory, kind) / GIB:.2f} GiB" for kind in _PEAK_KINDS
                          if getattr(memory, kind))
        lines.append(f"  rank 0's step (traced): peak {memory.peak / GIB:.2f} GiB, held then as {kinds}")
    elif untraced:
        lines.append(f"  step not traced: {untraced}")
    if device is not None:
        share = sum(states.values()) / device.memory_bytes
        peak = (f", the step's peak {memory.peak / device.memory_bytes:.0%}" if memory is not None
                else ", before activations, buffers and the transient peak")
        lines.append(f"  on {device.name} ({device.memory_bytes / GIB:.2f} GiB): the model states take {share:.0%}{peak}")
    if step_time is not None:
        lines.append(_time_line(step_time, device))
    return "\n".join(lines)


def render_search(name: str, world: int, device: DeviceProfile, ranked: list[Candidate], as_json: bool = False) -> str:
    """`hp plan --search`'s candidates (`hp.plan.search.search`, fastest first) as a table, or as one JSON line.

    >>> from hp.plan.devices import PROFILES
    >>> ranked = [Candidate({"dp": 2}, StepMemory(1, 0, 1, 2, 3, 0, 0, 0, 7 * GIB, 4),
    ...                     StepTime(0.5, 0.1, 0.2, 0.8), tokens=4096), Candidate({"tp": 2, "sp": True}, refused="no")]
    >>> print(render_search("m", 2, PROFILES["h100-80g"], ranked))
    hp plan --search: m on 2 ranks of h100-80g, 1 of 2 candidates run (fastest first)
           step  tokens/s  peak GiB  strategy
       800.0 ms      5120      7.00  dp=2
              -         -         -  tp=2 sp: no
    >>> untimed = Candidate({"dp": 2}, ranked[0].memory, StepTime(0.5, 0.1, 0.0, 0.6, untimed=4), tokens=4096)
    >>> print(render_search("m", 2, PROFILES["h100-80g"], [untimed]).splitlines()[-1])
      h100-80g has no figures for its links: these steps leave their collectives out (parallel: auto measures a CPU's link between two processes)
    """
    if as_json:
        return json.dumps({"model": name, "world": world, "device": device.name,
                           "candidates": [c.to_dict() for c in ranked]})
    runs = sum(c.runs for c in ranked)
    lines = [f"hp plan --search: {name} on {world} ranks of {device.name}, {runs} of {len(ranked)} candidates run "
             "(fastest first)", f"  {'step':>9}  {'tokens/s':>8}  {'peak GiB':>8}  strategy"]
    for c in ranked:
        label = describe(c.strategy)
        if c.runs:
            lines.append(f"  {_seconds(c.time.total):>9}  {c.tokens_per_s:>8.0f}  {c.memory.peak / GIB:>8.2f}  {label}")
        else:
            peak = f"{c.memory.peak / GIB:.2f}" if c.memory is not None else "-"
            lines.append(f"  {'-':>9}  {'-':>8}  {peak:>8}  {label}: {c.refused.splitlines()[0]}")
    if any(c.time is not None and c.time.untimed for c in ranked):
        lines.append(f"  {device.name} has no figures for its links: these steps leave their collectives out "
                     "(parallel: auto measures a CPU's link between two processes)")
    return "\n".join(lines)


def _time_line(step: StepTime, device: DeviceProfile) -> str:
    untimed = f"; {step.untimed} collectives not timed: {device.name} has no figures for their links" \
        if step.untimed else ""
    return (f"  rank 0's step on {device.name}: {_seconds(step.total)} predicted (kernels {_seconds(step.compute)}, "
            f"the host's dispatch {_seconds(step.host)}, collectives {_seconds(step.communication)}{untimed})")


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


_PEAK_KINDS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "buffers", "inputs", "other")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"

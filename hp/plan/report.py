"""What `hp plan` prints: a dry run as a few lines for the terminal, or as one JSON line for tools."""

from __future__ import annotations

import json

from hp.plan.dry_run import DryRun

GIB = 1024**3


def render(name: str, run: DryRun, *, as_json: bool = False) -> str:
    """The dry run of model `name` as text, or as JSON with the model's name added.

    >>> print(render("m", DryRun(8, "dp=8 fsdp", 8_000_000_000, 1_000_000_000, 1_000_000_000, (), 0.5)))
    hp plan: m, dp=8 fsdp on 8 ranks (laid out in 0.5 s)
      parameters: 8.00 B in all, 1.00 B on rank 0
      rank 0's model states: parameters 3.73 GiB, gradients 3.73 GiB, optimizer states 7.45 GiB (14.90 GiB)
      every split divides evenly
    """
    if as_json:
        return json.dumps({"model": name, **run.to_dict()})
    states = run.state_bytes
    parts = ", ".join(f"{kind.replace('_', ' ')} {size / GIB:.2f} GiB" for kind, size in states.items())
    lines = [f"hp plan: {name}, {run.strategy} on {run.world} ranks (laid out in {run.seconds:.1f} s)",
             f"  parameters: {_count(run.parameters)} in all, {_count(run.rank_parameters)} on rank 0",
             f"  rank 0's model states: {parts} ({sum(states.values()) / GIB:.2f} GiB)"]
    if run.uneven:
        lines.append("  splits that do not divide (FSDP pads them: rank 0 holds the larger piece):")
        lines.extend(f"    {split}" for split in run.uneven)
    else:
        lines.append("  every split divides evenly")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"

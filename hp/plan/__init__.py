"""What a training config needs on N accelerators, from hp's own layout code, before any is rented.

`hp plan` lays a model out at the target world size in one process: the
model is built on the meta device (no memory), the world is a fake process
group of N ranks, and `hp.apply_strategy` places every parameter as a
training run would. `reference_config` names published model shapes
(`shapes`); `dry_run` reports what rank 0 holds and whether the strategy is
legal at that size (`dry_run`); `step` is the training step traced on fake
tensors (and run on real ones to check it), whose memory `memory` tracks
and whose time `step_time` predicts from the kernels `kernels` counts;
`devices` holds the accelerators' profiles both are set against; `search`
ranks every split of a world by its traced step on one of them, `auto`
takes its first for `parallel: auto` (in processes `forked` for it), and
`report` prints what the CLI shows.

May import `hp.train`, `hp.models` and every layer below them; only the CLI
imports this package.
"""

from hp.plan.dry_run import DryRun, dry_run, dry_run_config, hf_config_of
from hp.plan.shapes import REFERENCES, reference_config

__all__ = ["REFERENCES", "DryRun", "dry_run", "dry_run_config", "hf_config_of", "reference_config"]

"""Where a run's numbers go: `output_dir/metrics.jsonl` always, TensorBoard when `report_to` names it.

One record per logging step or evaluation (a dict of numbers with its
`step`) is appended to metrics.jsonl as strict JSON, and written as scalars
to TensorBoard's event files in `logging_dir` (default `output_dir/runs`) when the config's
`report_to` holds "tensorboard" (HF Trainer's tag names: `train/loss`,
`train/lr`, `eval/loss`, ...). A resumed run first drops what was recorded
past its checkpoint, in both, so every step appears once.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRICS = "metrics.jsonl"
TENSORBOARD_DIR = "runs"


class Reporter:
    """Rank 0's sinks for one run.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     with Reporter(out, (), resumed_at=0) as report:
    ...         report.write({"step": 1, "loss": 2.5})
    ...     print(open(os.path.join(out, METRICS)).read().strip())
    {"step": 1, "loss": 2.5}
    """

    def __init__(self, output_dir: str, report_to: tuple[str, ...], *, resumed_at: int,
                 logging_dir: str | None = None) -> None:
        self.path = os.path.join(output_dir, METRICS)
        _keep_until(self.path, resumed_at)
        self.tensorboard = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: the events from it on (a crashed run's, past the checkpoint) are dropped on resume
            self.tensorboard = SummaryWriter(logging_dir or os.path.join(output_dir, TENSORBOARD_DIR),
                                             purge_step=resumed_at + 1 if resumed_at else None)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(_tag(key), value, record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def logged(output_dir: str) -> list[dict[str, Any]]:
    """The records a run wrote to its metrics.jsonl, in order ([] when there are none; a line being written
    when the run died is left out).

    >>> logged("/nonexistent")
    []
    """
    records = []
    try:
        with open(os.path.join(output_dir, METRICS)) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        return []
    return records


def _tag(key: str) -> str:
    """HF Trainer's tags: eval_loss -> eval/loss, loss -> train/loss."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def _keep_until(path: str, step: int) -> None:
    """Drop the lines of `path` past `step`: a resumed run logs those steps again."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)

"""A run's numbers: metrics.jsonl always, TensorBoard events in logging_dir, each step once after a resume."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hp.train.report import METRICS, Reporter


def test_tensorboard_events_go_to_logging_dir_and_a_resume_drops_what_came_after_its_checkpoint(tmp_path):
    logs = tmp_path / "tb"
    with Reporter(str(tmp_path), ("tensorboard",), resumed_at=0, logging_dir=str(logs)) as report:
        for step in range(1, 6):  # a run that got to step 5, checkpointed at 3
            report.write({"step": step, "loss": 10.0 - step, "lr": 0.1})
        report.write({"step": 5, "eval_loss": 4.5, "eval_perplexity": 90.0})
    with Reporter(str(tmp_path), ("tensorboard",), resumed_at=3, logging_dir=str(logs)) as report:
        for step in range(4, 7):
            report.write({"step": step, "loss": 20.0 - step, "lr": 0.1})
    records = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 9), (2, 8), (3, 7), (4, 16), (5, 15), (6, 14)]
    events = EventAccumulator(str(logs))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 9), (2, 8), (3, 7), (4, 16), (5, 15),
                                                                          (6, 14)]
    assert events.Scalars("eval/loss") == []  # written past the checkpoint: purged with the rest
    assert not (tmp_path / "runs").exists()

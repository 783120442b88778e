"""`hp train`'s step under pipeline parallel: the accumulated batches through `hp.pipeline`'s schedule.

Without pp a step is the objective's forward and backward per accumulated
batch (`hp.train.loop`); with pp the schedule runs both, micro-batch by
micro-batch, so the step hands each batch to `Pipeline.step` with the
scale that makes the accumulated gradients the mean over every batch.
"""

from __future__ import annotations

from hp.parallel.pipeline import Pipeline
from hp.train.precision import autocast

# Under pp a batch's tokens are padded to a multiple of this: each length the pipeline meets builds a
# schedule of its own (torch's stages size their buffers by the first batch), so few lengths, few schedules.
LENGTH_STEP = 64


def pipelined_step(pipe: Pipeline, batches, accumulate: int, bf16: bool, device: str) -> tuple[float, int, dict]:
    """One optimizer step's forward and backward over `accumulate` batches; (loss, tokens, no rewards)."""
    bf16_autocast = autocast(bf16, device)
    total, tokens = 0.0, 0
    for _ in range(accumulate):
        batch = next(batches)
        with bf16_autocast:
            loss = pipe.step(batch.input_ids.to(device), batch.labels.to(device), scale=1 / accumulate)
        total += float(loss)
        tokens += batch.input_ids.numel()
    return total, tokens, {}

"""Worker for test_plan.py: rank 0's step traced on a fake world against the same step run on 2 gloo processes.

Under FSDP with recompute, the step peaks in the root unit's reduce-scatter, where gloo copies its input: the trace
counts that buffer (`hp.plan.memory.LIBRARY_BUFFERS`) and gives the measured peak; without it, it falls short by
the copy. (tp + sp's reduce-scatters are DTensor's functional ones, where gloo copies nothing: benchmarks/plan.py
measures them on gloo, to the byte.) Every check raises on failure.
"""

from __future__ import annotations

import os

import torch

from hp.models import tiny_config
from hp.plan.memory import measure_step, trace_step
from hp.plan.step import StepShape

CONFIG = tiny_config("llama", layers=2, vocab_size=8192, hidden_size=128, intermediate_size=256)
SHAPE = StepShape(rows=4, tokens=32)


def main() -> None:
    torch.distributed.init_process_group("gloo")
    fsdp = {"dp": 2, "fsdp": True, "recompute": True}
    measured = measure_step(CONFIG, fsdp, SHAPE)
    torch.distributed.destroy_process_group()
    if os.environ["RANK"] != "0":
        return
    traced = trace_step(CONFIG, fsdp, SHAPE, backend="gloo")
    # plain data parallel's trace supervises every position without reading the labels: within 0.5% (without
    # gloo's copy, the trace falls 20% short)
    assert abs(traced.peak - measured.peak) <= 0.005 * measured.peak, (traced, measured)
    print("rank 0: traced as measured on gloo", flush=True)


if __name__ == "__main__":
    main()

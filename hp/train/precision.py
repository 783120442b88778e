"""The step's mixed precision: `bf16: true` runs forwards under bf16 autocast, as HF Trainer does.

One helper for every way a step runs (plain, pipelined, placed, evaluation),
so that what the placement probes measure runs as the step will.

>>> import torch
>>> with autocast(True, "cpu"):
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def autocast(bf16: bool, device: str | torch.device) -> AbstractContextManager:
    """bf16 autocast on `device`'s type when `bf16`, else nothing."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16) if bf16 else nullcontext()

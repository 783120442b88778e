"""What the example scripts share: a tp mesh, simulated or launched, and an error measure."""

from __future__ import annotations

import contextlib
import os

import torch

import hp


def tp_mesh(simulate: int):
    """(mesh, context): `simulate` ranks in this process, else torchrun's world on one tp axis."""
    if simulate:
        mesh = hp.mesh(tp=simulate, simulate=True)
        return mesh, hp.simulated(mesh)
    return hp.mesh(tp=int(os.environ.get("WORLD_SIZE", "1"))), contextlib.nullcontext()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in the 2-norm."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))

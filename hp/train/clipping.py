"""Gradient clipping for every way `hp train` lays a model out: plain, DTensor, pipeline stages, placed programs.

The global norm is taken over every gradient once: DTensor gradients reduce
over their own meshes, pipeline stages' squared norms add up over the
pipeline's group, and (`clip_counted`) a head tied to the embedding of
another stage, or under `parallel.mpmd.place` a program held whole on
several ranks (a spread vision tower), counts on one of them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hp.mpmd.placed import Placed
from hp.parallel.pipeline import Pipeline


def clip_gradients(params, max_norm: float, *, group=None) -> float:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm before.

    Like `torch.nn.utils.clip_grad_norm_`, for any mix of plain and DTensor gradients on any
    meshes (each norm is reduced over its own mesh first); `group` is one over whose ranks the
    parameters differ (pipeline stages), where the squared norms add up.

    >>> p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 3.0)
    >>> clip_gradients([p], 1.0), p.grad.norm().item()
    (6.0, 1.0)
    """
    groups: dict[tuple, list[torch.Tensor]] = {}  # one reduction per layout, not one per gradient
    for p in params:
        if p.grad is not None:
            layout = (id(p.grad.device_mesh), p.grad.placements) if hasattr(p.grad, "device_mesh") else ()
            groups.setdefault((layout, p.grad.dtype), []).append(p.grad.detach())
    squared = sum(scalar(torch.nn.utils.get_total_norm([g.float() for g in grads])) ** 2 for grads in groups.values())
    if group is not None:
        summed = torch.tensor([float(squared)], dtype=torch.float64)
        dist.all_reduce(summed, group=group)
        squared = summed.item()
    total = squared ** 0.5
    if total > max_norm:
        for grads in groups.values():
            torch._foreach_mul_(grads, max_norm / total)
    return total


def scalar(loss) -> float:
    """A loss (a plain tensor or a DTensor) as a Python float."""
    full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return float(full.detach())


def clip_counted(step: Placed | Pipeline, max_norm: float) -> float:
    """Clip the gradients of a step whose ranks hold some parameters twice (a placed step's spread program, a
    pipeline's tied head and embedding) to a global norm of `max_norm`, each parameter counted once over
    the ranks (its `counted_parameters`); returns the norm before. A collective."""
    total = clip_gradients(step.counted_parameters(), math.inf, group=step.group or dist.group.WORLD)  # a replica
    grads = [p.grad for p in step.parameters() if p.grad is not None]  # none on a rank running frozen programs only
    if total > max_norm and grads:
        torch._foreach_mul_(grads, max_norm / total)
    return total

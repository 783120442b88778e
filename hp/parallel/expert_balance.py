"""Expert load balance: what a trainer reports, and a correction that needs no auxiliary loss.

A mixture-of-experts layer trains well only when its router spreads tokens
over the experts; under expert parallel an overloaded expert also makes its
rank the slowest. `ExpertLoad` holds the tokens each expert got in a step,
summed over ranks (`hp.ops.expert_parallel.expert_loads` counts them), and
its imbalance: the most loaded expert over the mean, 1.0 when even.

The auxiliary-loss-free balancing of DeepSeek-V3 (also in torchtitan) adds
a per-expert bias to the routing scores when choosing the top-k experts,
never to the weights the outputs are mixed with, and after each step moves
every bias a fixed `rate` toward balance: up for an expert below the mean
load, down for one above (`nudge_routing_bias`). `biased_routing` sets it up
on routers that return `(logits, weights, expert_ids)` from a softmax over
the logits, top-k and an optional renormalisation (`norm_topk_prob`), as
HF's Qwen-MoE routers do. The bias is a buffer of the router, so
checkpoints keep it and a resumed run routes as the run it continues.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hp.ops.expert_parallel import expert_loads

BIAS = "expert_bias"  # the router buffer that holds the routing bias


@dataclass(frozen=True)
class ExpertLoad:
    """(token, k) rows per expert of each MoE layer in one step, summed over ranks.

    >>> load = ExpertLoad(((3, 1, 2, 2), (2, 2, 2, 2)))
    >>> load.imbalance, load.total
    (1.5, 16)
    """

    per_layer: tuple[tuple[int, ...], ...]

    @property
    def imbalance(self) -> float:
        """The largest over layers of (most loaded expert / mean load); 1.0 is perfectly even."""
        ratios = [max(layer) * len(layer) / sum(layer) for layer in self.per_layer if sum(layer)]
        return max(ratios, default=1.0)

    @property
    def total(self) -> int:
        return sum(sum(layer) for layer in self.per_layer)


def measure(model: nn.Module) -> ExpertLoad | None:
    """The load since the last call, over every experts module of `model` (None if it has none).

    Collective over the ranks that split tokens: every rank calls it, at the same point.
    """
    loads = expert_loads(model)
    if not loads:
        return None
    return ExpertLoad(tuple(tuple(int(n) for n in _plain(load).tolist()) for load in loads))


def biased_routing(model: nn.Module, routers: Sequence[str]) -> list[nn.Module]:
    """Give each router of `model` named by `routers` a zero routing bias, used to pick the top-k experts.

    >>> import torch
    >>> class Router(torch.nn.Module):
    ...     top_k, num_experts, norm_topk_prob = 1, 2, False
    ...     def forward(self, x):
    ...         logits = x
    ...         weights, ids = torch.softmax(logits, -1).topk(1)
    ...         return logits, weights, ids
    >>> moe = torch.nn.ModuleDict({"gate": Router()})
    >>> router, = biased_routing(moe, ["gate"])
    >>> router.expert_bias += torch.tensor([0.0, 5.0])
    >>> moe["gate"](torch.tensor([[2.0, 0.0]]))[2]  # the bias, not the score, picks expert 1
    tensor([[1]])
    """
    found = [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in routers)]
    for router in found:
        if not hasattr(router, BIAS):
            router.register_buffer(BIAS, torch.zeros(router.num_experts), persistent=True)
            router.forward = functools.partial(_biased_forward, router, router.forward)
    return found


def nudge_routing_bias(model: nn.Module, load: ExpertLoad, rate: float) -> None:
    """Move each router's bias by `rate` toward the mean load: + below it, - above it (DeepSeek-V3).

    The routers and the load's layers pair up in module order (one router per MoE layer).
    """
    routers = [m for m in model.modules() if hasattr(m, BIAS)]
    if len(routers) != len(load.per_layer):
        raise ValueError(f"{len(routers)} biased routers but a load of {len(load.per_layer)} MoE layers")
    with torch.no_grad():
        for router, layer in zip(routers, load.per_layer):
            counts = torch.tensor(layer, dtype=torch.float32)
            step = rate * torch.sign(counts.mean() - counts)
            getattr(router, BIAS).add_(step.to(getattr(router, BIAS).device))


def _biased_forward(router: nn.Module, forward, hidden):
    """The router's logits, with its top-k experts chosen by softmax score + bias and weighted by the score."""
    logits, weights, _ = forward(hidden)
    scores = torch.softmax(logits, dim=-1, dtype=torch.float)
    expert_ids = torch.topk(scores + getattr(router, BIAS), router.top_k, dim=-1).indices
    top = scores.gather(-1, expert_ids)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(weights.dtype), expert_ids


def _plain(load: torch.Tensor) -> torch.Tensor:
    """A tensor's values on this rank (the first simulated rank's, under a simulation)."""
    local = getattr(load, "_local_tensors", None)
    return local[min(local)] if local else load

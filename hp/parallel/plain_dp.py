"""Plain data parallel: whole plain parameters, each rank its own rows, gradients summed while backward runs.

Why: when only the batch is split (dp alone: no tp, cp, ep or FSDP), laying
every parameter out as a replicated DTensor buys nothing and costs DTensor's
dispatch on every op of every step. Here the parameters stay plain tensors
and the model sees its rank's rows of the global batch. What the layout
promised is kept at the model's edges, so the training step, evaluation and
preference losses read the same values either way: the logits come back
laid out `b/dp ...`, and the loss as a pending sum over dp whose parts are
each rank's tokens' loss over the global count of supervised tokens (HF's
`num_items_in_batch`, which every rank counts from the global batch it
holds), so `full_tensor()` gives the global mean, as on the DTensor path.
With labels, a rank's rows are also cut after their last supervised column
(the global batch is padded to its longest row; HF's collator pads each
rank's rows to their own); the logits of such a call are then the rank's
block as it is, a plain tensor (call without labels for laid-out logits).

Gradients are summed over dp in buckets as backward produces them, DDP's
scheme: each parameter's post-accumulate hook counts it into its bucket, and
the all-reduce of the first buckets whose gradients are all in flies while
backward goes on; `finish` (called by `hp.reduce_gradients`) sends the rest
and writes the sums back. Buckets go out in one order on every rank, on a
process group of their own, so a rank whose bucket waits for a parameter the
batch left unused there (an expert nobody routed to) cannot cross another
collective. `accumulating(model)` holds the reductions back for all but the
last micro-batch of an accumulated step (DDP's `no_sync`).

Simulated meshes (`hp.simulated`) keep the DTensor path: per-rank values in
one process need DTensors.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hp.layouts import from_local
from hp.mesh import name_group
from hp.parallel.sequence import IGNORE_INDEX

BUCKET_ELEMENTS = 1 << 22  # gradient elements per all-reduce (16 MiB in fp32): DDP's size, to overlap backward


def takes_plain_dp(model: nn.Module, mesh, strategy) -> bool:
    """Whether `strategy` splits only the batch, on real processes, of a model whose loss takes the global count
    and mixes no rows (no router auxiliary loss)."""
    transformed = strategy.mpmd is not None or strategy.offload is not None  # they work on DTensor steps
    real = dist.is_initialized() and dist.get_backend() != "fake"
    # A router's auxiliary loss balances the load over the whole batch: the DTensor path computes it over all rows.
    batch_wide = getattr(getattr(model, "config", None), "output_router_logits", False)
    return strategy.only_batch and not transformed and real and not batch_wide and _takes_loss_kwargs(model)


def _takes_loss_kwargs(model: nn.Module) -> bool:
    """HF Trainer's test: a forward with **kwargs hands `num_items_in_batch` to its loss."""
    forward = inspect.signature(model.forward).parameters
    return "num_items_in_batch" in forward or any(p.kind is p.VAR_KEYWORD for p in forward.values())


def plain_data_parallel(model: nn.Module, mesh) -> nn.Module:
    """Run `model` data parallel over `mesh`'s dp axis (or alone on a one-rank mesh) with plain parameters.

    >>> # on real processes, what hp.apply_strategy does for {"dp": N}: tests/workers/zoo_gloo.py, check_plain_dp
    """
    dp = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
    model._hp_reducer = _Reducer(dp) if dp is not None and dp.size() > 1 else None
    cut: list[bool] = [False]  # whether the latest call's rows were cut short (the pre-hook tells the hook)
    model.register_forward_pre_hook(_rows_of_this_rank(dp, model._hp_reducer, cut), with_kwargs=True)
    model.register_forward_hook(_laid_out(mesh, "dp" if dp is not None else None, cut))
    return model


def finish(model: nn.Module) -> bool:
    """Wait for `model`'s gradient sums and write them back; False when it does not run plain data parallel."""
    if not hasattr(model, "_hp_reducer"):
        return False
    if model._hp_reducer is not None:
        model._hp_reducer.finish()
    return True


@contextlib.contextmanager
def accumulating(model: nn.Module) -> Iterator[None]:
    """Backward passes inside add to the gradients without summing them over dp (all but the last micro-batch)."""
    reducer = getattr(model, "_hp_reducer", None)
    if reducer is None:
        yield
        return
    reducer.holding = True
    try:
        yield
    finally:
        reducer.holding = False


def _rows_of_this_rank(dp, reducer: _Reducer | None, cut: list[bool]):
    """A pre-hook: each batch-shaped argument cut to this rank's rows (and, with labels, to their last
    supervised column); the loss over the global supervised count."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if reducer is not None and torch.is_grad_enabled():
            reducer.attach(module)
        if args:
            raise TypeError("hp's plain data parallel takes the model's inputs by keyword (input_ids=..., labels=...)")
        rows = _batch_size(kwargs)
        labels = kwargs.get("shift_labels", kwargs.get("labels"))
        if labels is not None and kwargs.get("num_items_in_batch") is None:
            shifted = labels if "shift_labels" in kwargs else labels[..., 1:]  # HF shifts labels by one
            kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        cut[0] = False
        if dp is None or rows is None:
            return args, kwargs
        if rows % dp.size():
            raise ValueError(f"a batch of {rows} rows does not split evenly over dp={dp.size()}")
        share = rows // dp.size()
        start = dp.get_local_rank() * share
        mine = {k: v[start:start + share] if _batched(v, rows) else v for k, v in kwargs.items()}
        return args, _to_last_supervised(mine, share, cut)

    return hook


def _to_last_supervised(kwargs: dict, rows: int, cut: list[bool]) -> dict:
    """This rank's rows without the columns past their last supervised label: a global batch is padded to its
    longest row, and computing the rest on a rank whose rows are shorter changes no loss or gradient (causal
    attention, right padding; HF's collator pads each rank's rows to their own longest too)."""
    labels = kwargs.get("labels")
    if labels is None or "shift_labels" in kwargs or labels.dim() < 2:
        return kwargs
    width = labels.shape[1]
    supervised = (labels != IGNORE_INDEX).any(0).nonzero()
    keep = int(supervised.max()) + 1 if len(supervised) else 1  # a column more than the last prediction reads
    if keep >= width:
        return kwargs
    cut[0] = True
    return {k: v[:, :keep] if _batched(v, rows) and v.dim() > 1 and v.shape[1] == width else v
            for k, v in kwargs.items()}


def _batch_size(kwargs: dict) -> int | None:
    first = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    return None if first is None else first.shape[0]


def _batched(value: object, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _laid_out(mesh, axis: str | None, cut: list[bool]):
    """A forward hook: the logits laid out `b/dp ...` (this rank's block as it is when its rows were cut short)
    and the loss a pending sum over dp, as DTensors."""
    split = f"/{axis}" if axis else ""

    def hook(module: nn.Module, args: tuple, output):
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and not cut[0]:
            output.logits = from_local(logits, " ".join([f"b{split}", *(f"d{i}" for i in range(1, logits.dim()))]),
                                       mesh)
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            output.loss = from_local(loss, f"+{axis}" if axis else "", mesh)
        return output

    return hook


class _Reducer:
    """Sums `params`' gradients over the dp group in buckets, as backward produces them."""

    def __init__(self, dp) -> None:
        self.group = dist.new_group(dist.get_process_group_ranks(dp.get_group()))  # its own collective order
        name_group(self.group, "dp")  # hp.comm.trace counts its sums as dp's
        self.buckets: list[list[nn.Parameter]] = []
        self.bucket_of: dict[nn.Parameter, int] = {}
        self.holding = False
        self._reset()

    def attach(self, model: nn.Module) -> None:
        """Bucket the parameters `model` trains now, hooked once each. Checked at every forward, as loading
        weights onto a model laid out on the meta device (`to_empty`) makes new parameters, and
        fine-tuning may freeze some after the layout."""
        params = [p for p in model.parameters() if p.requires_grad]
        if len(params) == len(self.bucket_of) and all(p in self.bucket_of for p in params):
            return
        self.buckets = _buckets(list(reversed(params)))  # backward meets the last layers first
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        for param in params:
            if not getattr(param, "_hp_summed_over_dp", False):
                param.register_post_accumulate_grad_hook(self._ready)
                param._hp_summed_over_dp = True
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.sent: list[tuple[torch.Tensor, object]] = []

    def _ready(self, param: nn.Parameter) -> None:
        if self.holding or param not in self.bucket_of:
            return
        self.waiting[self.bucket_of[param]] -= 1
        while len(self.sent) < len(self.buckets) and self.waiting[len(self.sent)] == 0:
            self._send(len(self.sent))

    def _send(self, index: int) -> None:
        bucket = self.buckets[index]
        for p in bucket:  # a parameter the batch left unused on this rank adds zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self.sent.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        while len(self.sent) < len(self.buckets):
            self._send(len(self.sent))
        for bucket, (flat, work) in zip(self.buckets, self.sent):
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._reset()


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` in runs of at most BUCKET_ELEMENTS elements of one dtype (a larger parameter alone)."""
    runs: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        if not runs or size + param.numel() > BUCKET_ELEMENTS or runs[-1][0].dtype != param.dtype:
            runs.append([])
            size = 0
        runs[-1].append(param)
        size += param.numel()
    return runs

"""Plain data parallel: whole plain parameters, each rank its own rows, gradients summed while backward runs.

Why: when only the batch is split (dp alone: no tp, cp or ep), laying
every parameter out as a replicated DTensor buys nothing and costs DTensor's
dispatch on every op of every step. Here the parameters stay plain tensors
and the model sees its rank's rows of the global batch. What the layout
promised is kept at the model's edges, so the training step, evaluation and
preference losses read the same values either way: the logits come back
laid out `b/dp ...`, and the loss as a pending sum over dp whose parts are
each rank's tokens' loss over the global count of supervised tokens (HF's
`num_items_in_batch`, which every rank counts from the global batch it
holds), so `full_tensor()` gives the global mean, as on the DTensor path.

With labels, three things make a rank's share cheaper, none changing a sum:

- the rows are dealt out by their padded tokens (`balanced_rows`): a rank
  pads its rows to its widest, so the rank holding the longest row takes
  fewer rows;
- a rank's rows are cut after their last supervised column (HF's collator
  pads each rank's rows to their own longest too);
- the LM head and the loss see the supervised positions only (HF's boolean
  `logits_to_keep` with `shift_labels`), where the model computes its logits
  through `slice_logits_to_keep`.

The logits of such a call are then the rank's own, a plain tensor (call
without labels for laid-out logits).

Gradients are summed over dp in buckets as backward produces them, DDP's
scheme: each parameter's post-accumulate hook counts it into its bucket, and
the all-reduce of the first buckets whose gradients are all in flies while
backward goes on; `finish` (called by `hp.reduce_gradients`) sends the rest
and waits. The gradients are views of the buckets' buffers, so they are
read after `hp.reduce_gradients` (until then a sum may be in flight). Buckets go out
in one order on every rank, on a process group of their own, so a rank
whose bucket waits for a parameter the batch left unused there (an expert
nobody routed to) cannot cross another collective. `accumulating(model)`
holds the reductions back for all but the last micro-batch of an
accumulated step (DDP's `no_sync`). With FSDP over dp alone, FSDP2 shards
the plain parameters on the dp axis and its reduce-scatter sums instead.

Simulated meshes (`hp.simulated`) keep the DTensor path: per-rank values in
one process need DTensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hp.layouts import from_local
from hp.ops.expert_parallel import LOADS_GROUP
from hp.mesh import name_group
from hp.parallel.sequence import IGNORE_INDEX

# Set on a model whose caller runs some of its modules outside its forward (a reward model's value head on
# its hidden states): plain data parallel lays out only what the forward returns, so such a model keeps the
# DTensor path.
USED_OUTSIDE_FORWARD = "_hp_used_outside_forward"
BUCKET_ELEMENTS = 1 << 22  # gradient elements per all-reduce (16 MiB in fp32): DDP's size, to overlap backward


def takes_plain_dp(model: nn.Module, mesh, strategy) -> bool:
    """Whether `model` runs plain data parallel under `strategy` here: `plain_dp_layout`, on real processes (or on a
    fake world standing for them, `as_on_real_processes`)."""
    real = dist.is_initialized() and (dist.get_backend() != "fake" or _AS_ON_REAL_PROCESSES.get())
    return real and plain_dp_layout(model, strategy)


_AS_ON_REAL_PROCESSES = contextvars.ContextVar("as_on_real_processes", default=False)


@contextlib.contextmanager
def as_on_real_processes() -> Iterator[None]:
    """Models laid out inside run plain data parallel on a fake process group too, as they would on real
    processes: for a step traced as rank 0 of a real run (`hp.plan.memory`), not one simulated rank by rank.

    >>> with as_on_real_processes():
    ...     _AS_ON_REAL_PROCESSES.get()
    True
    """
    token = _AS_ON_REAL_PROCESSES.set(True)
    try:
        yield
    finally:
        _AS_ON_REAL_PROCESSES.reset(token)


def plain_dp_layout(model: nn.Module, strategy) -> bool:
    """Whether `strategy` splits only the batch (dp, FSDP over dp allowed) of a model whose loss takes the global
    count and mixes no rows (no router auxiliary loss): plain data parallel on real processes (simulated ranks
    keep DTensors)."""
    transformed = strategy.mpmd is not None or strategy.offload is not None  # they work on DTensor steps
    # A router's auxiliary loss balances the load over the whole batch: the DTensor path computes it over all rows.
    batch_wide = getattr(getattr(model, "config", None), "output_router_logits", False)
    only_rows = strategy.only_batch or (strategy.fsdp_axes == ("dp",) and strategy.tp == strategy.cp == 1
                                        and strategy.tp2d is None)
    outside = getattr(model, USED_OUTSIDE_FORWARD, False)
    return only_rows and not transformed and not batch_wide and not outside and _takes_loss_kwargs(model)


def _takes_loss_kwargs(model: nn.Module) -> bool:
    """HF Trainer's test: a forward with **kwargs hands `num_items_in_batch` to its loss."""
    forward = inspect.signature(model.forward).parameters
    return "num_items_in_batch" in forward or any(p.kind is p.VAR_KEYWORD for p in forward.values())


def plain_data_parallel(model: nn.Module, mesh, *, sums: bool = True) -> nn.Module:
    """Run `model` data parallel over `mesh`'s dp axis (or alone on a one-rank mesh) with plain parameters;
    without `sums`, FSDP sums the gradients (`hp.parallel.data_parallel.fully_shard_plain`, applied before).

    >>> # on real processes, what hp.apply_strategy does for {"dp": N}: tests/workers/zoo_gloo.py, check_plain_dp
    """
    dp = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
    model._hp_reducer = _Reducer(dp) if sums and dp is not None and dp.size() > 1 else None
    if dp is not None and dp.size() > 1:
        setattr(model, LOADS_GROUP, dp.get_group())  # each rank counts its rows' expert loads: summed over dp
    cut: list[bool] = [False]  # whether the latest call's logits are not its whole rows (the pre-hook tells the hook)
    # first of the pre-hooks: a refused batch must not leave FSDP's root half into its forward
    model.register_forward_pre_hook(_rows_of_this_rank(dp, model._hp_reducer, cut, selects_logits(model)),
                                    with_kwargs=True, prepend=True)
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
    sharded = hasattr(model, "_hp_reducer") and hasattr(model, "set_requires_gradient_sync")  # FSDP2's root
    if reducer is not None:
        reducer.holding = True
    if sharded:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        if reducer is not None:
            reducer.holding = False
        if sharded:
            model.set_requires_gradient_sync(True)


def _rows_of_this_rank(dp, reducer: _Reducer | None, cut: list[bool], selects: bool):
    """A pre-hook: each batch-shaped argument cut to this rank's rows (and, with labels, to their last
    supervised column, and the logits to the supervised positions when the model `selects`); the loss over the
    global supervised count."""

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
        if dp is not None and rows is not None:
            if rows % dp.size():
                raise ValueError(f"a batch of {rows} rows does not split evenly over dp={dp.size()}")
            mine = _my_rows(kwargs.get("labels") if "shift_labels" not in kwargs else None, rows, dp, cut)
            share = len(range(rows)[mine]) if isinstance(mine, slice) else len(mine)
            kwargs = _to_last_supervised({k: v[mine] if _batched(v, rows) else v for k, v in kwargs.items()},
                                         share, cut)
        return args, _supervised_logits(kwargs, cut) if selects else kwargs

    return hook


def _my_rows(labels: torch.Tensor | None, rows: int, dp, cut: list[bool]) -> slice | torch.Tensor:
    """This rank's rows: an equal share in order, or with labels, a share balanced by padded tokens."""
    if labels is None or labels.dim() != 2:
        share = rows // dp.size()
        return slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)
    columns = torch.arange(labels.shape[1], device=labels.device)
    widths = (torch.where(labels != IGNORE_INDEX, columns, 0).amax(1) + 1).tolist()
    cut[0] = True  # the logits are this rank's rows, in its own order
    return torch.tensor(balanced_rows(widths, dp.size())[dp.get_local_rank()], device=labels.device)


def balanced_rows(widths: list[int], ranks: int) -> list[list[int]]:
    """The rows (by index) each of `ranks` takes, so that the most padded tokens a rank computes is least.

    A rank pads its rows to its widest, so it computes rows x widest tokens; equal shares in the
    batch's order leave the rank with the longest row as many rows as the others. Here the rows,
    widest first, are cut into runs of at most `limit` padded tokens, with the least `limit` that
    needs no more runs than ranks. The loss and gradients are sums over rows, whichever rank
    computes each, so this changes which rank waits, not what is computed.

    >>> balanced_rows([100, 10, 10, 10, 10, 10], 2)
    [[0], [1, 2, 3, 4, 5]]
    >>> balanced_rows([5, 5, 5, 5], 2)
    [[0, 1], [2, 3]]
    """
    order = sorted(range(len(widths)), key=lambda i: (-widths[i], i))

    def runs(limit: int) -> list[list[int]]:
        out, i = [], 0
        while i < len(order):
            count = max(1, limit // widths[order[i]])
            out.append(order[i:i + count])
            i += count
        return out

    low, high = widths[order[0]], widths[order[0]] * -(-len(order) // ranks)  # high: equal runs fit
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(runs(middle)) <= ranks else (middle + 1, high)
    found = runs(low)
    while len(found) < ranks:  # every rank takes a row: halve the longest run (neither half costs more)
        longest = max(range(len(found)), key=lambda j: len(found[j]))
        run = found[longest]
        found[longest:longest + 1] = [run[:len(run) // 2], run[len(run) // 2:]]
    return found


def _supervised_logits(kwargs: dict, cut: list[bool]) -> dict:
    """With labels, the logits of the supervised positions only, as HF's boolean `logits_to_keep` selects them,
    and their targets as `shift_labels`: the LM head and the loss skip prompt and padding positions (a third of
    an SFT step's head on instruction data), and their sum is the same."""
    labels, asked = kwargs.get("labels"), kwargs.get("logits_to_keep")
    if labels is None or labels.dim() != 2 or "shift_labels" in kwargs or isinstance(asked, torch.Tensor) or asked:
        return kwargs
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = targets != IGNORE_INDEX
    cut[0] = True
    return {**kwargs, "logits_to_keep": keep, "shift_labels": targets[keep]}


def selects_logits(model: nn.Module) -> bool:
    """Whether `model` computes its logits through HF's `slice_logits_to_keep` (a boolean mask keeps the masked
    positions) and its loss is the causal LM's, which takes `shift_labels`."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    forward = inspect.unwrap(type(model).forward)
    if "slice_logits_to_keep" not in getattr(getattr(forward, "__code__", None), "co_names", ()):
        return False
    loss = model.__dict__.get("_loss_function") or LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM")
    return getattr(loss, "_torchdynamo_orig_callable", loss) is ForCausalLMLoss


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
    """Sums `params`' gradients over the dp group in buckets, as backward produces them.

    Each bucket is one flat buffer, and its parameters' gradients are views into it (DDP's
    `gradient_as_bucket_view`): backward accumulates into the buffer, which is all-reduced in place,
    with no copy into a bucket and back, and no second copy of the gradients in memory.
    """

    def __init__(self, dp) -> None:
        self.group = dist.new_group(dist.get_process_group_ranks(dp.get_group()))  # its own collective order
        name_group(self.group, "dp")  # hp.comm.trace counts its sums as dp's
        self.buckets: list[list[nn.Parameter]] = []
        self.flats: list[torch.Tensor] = []
        self.bucket_of: dict[nn.Parameter, int] = {}
        self.holding = False
        self._reset()

    def attach(self, model: nn.Module) -> None:
        """Bucket the parameters `model` trains now, hooked once each, and point their gradients into the
        buckets. Checked at every forward, as loading weights onto a model laid out on the meta device
        (`to_empty`) makes new parameters, fine-tuning may freeze some after the layout, and the optimizer
        sets gradients to None between steps."""
        params = [p for p in model.parameters() if p.requires_grad]
        if len(params) != len(self.bucket_of) or not all(p in self.bucket_of for p in params):
            self._rebucket(params)
        for bucket, flat in zip(self.buckets, self.flats):
            _into(bucket, flat)

    def _rebucket(self, params: list[nn.Parameter]) -> None:
        self.buckets = _buckets(list(reversed(params)))  # backward meets the last layers first
        self.flats = [torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                      for bucket in self.buckets]
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        for param in params:
            if not getattr(param, "_hp_summed_over_dp", False):
                param.register_post_accumulate_grad_hook(self._ready)
                param._hp_summed_over_dp = True
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.sent: list[object] = []

    def _ready(self, param: nn.Parameter) -> None:
        if self.holding or param not in self.bucket_of:
            return
        self.waiting[self.bucket_of[param]] -= 1
        while len(self.sent) < len(self.buckets) and self.waiting[len(self.sent)] == 0:
            self._send(len(self.sent))

    def _send(self, index: int) -> None:
        _into(self.buckets[index], self.flats[index])  # a gradient replaced since the forward joins its bucket
        self.sent.append(dist.all_reduce(self.flats[index], group=self.group, async_op=True))

    def finish(self) -> None:
        while len(self.sent) < len(self.buckets):
            self._send(len(self.sent))
        for work in self.sent:
            work.wait()
        self._reset()


def _into(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Make each of `params`' gradients a view of its place in `flat` (zeros where it had none)."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None and p.grad._base is flat and p.grad.storage_offset() == offset:
            offset += n
            continue  # its place already (asked of the view's base, not its address, which a fake tensor lacks)
        view = flat[offset:offset + n].view_as(p)
        offset += n
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad)
        p.grad = view


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

"""Cross-entropy on vocab-sharded logits without gathering them (loss parallel).

Logits of shape (N, V) split over V on one mesh axis stay split (rows may be
split too, plainly or strided, as flattening `b s/cp` leaves them): each rank
computes its slice's max, sum of exponentials and target logit, and three
all-reduces of N numbers over that axis combine them. The gradient is the
local softmax minus the local one-hot, never materialising (N, V) on a rank.
`ignore_index` rows contribute neither loss nor gradient and are left out of
the mean. Other cases (label smoothing, class weights, a sharded row and
vocab on one axis, ...) return NotImplemented and fall back to DTensor's
rules, which gather the logits: slower, still exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops.collectives import all_reduce
from hp.ops.local import to_dtensor


class _VocabParallelNLL(torch.autograd.Function):
    """Per-row loss from a local (N, V/p) logit slice; rows are replicated over the group."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, group, ignore_index: int):
        x = logits.float()
        row_max = all_reduce(x.max(dim=1).values, "max", group)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=1), "sum", group)
        local = _shift(target, vocab_start)
        mine = (local >= 0) & (local < x.shape[1]) & (target != ignore_index)
        index = local.clamp(0, x.shape[1] - 1)[:, None]
        picked = all_reduce(shifted.gather(1, index).squeeze(1) * mine, "sum", group)
        valid = target != ignore_index
        loss = (sum_exp.log() - picked) * valid
        ctx.save_for_backward(exp / sum_exp[:, None], index, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.scatter_add(1, index, -mine[:, None].to(softmax.dtype))
        grad = grad * (grad_loss * valid)[:, None]
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
):
    """`F.cross_entropy` for DTensor logits split on rows and/or classes; NotImplemented otherwise.

    With rows split and classes whole, each rank computes its rows' losses locally; the mean
    still divides by the global count of non-ignored rows (DTensor's own rule averages the
    per-rank means, which is wrong when ranks hold different numbers of ignored rows).
    """
    if not _applies(input, weight, size_average, reduce, label_smoothing):
        return NotImplemented
    if target.ndim != 1 or target.dtype.is_floating_point:  # class probabilities: DTensor's rules
        return NotImplemented
    mesh, placements = input.device_mesh, input.placements
    vocab_axis = next((m for m, p in enumerate(placements) if p == Shard(1)), None)
    rows = [p if _splits_rows(p) else Replicate() for p in placements]
    if not isinstance(target, DTensor):
        target = DTensor.from_local(target, mesh, [Replicate()] * mesh.ndim, run_check=False)
    local_target = target.redistribute(mesh, rows).to_local()
    if vocab_axis is None:
        loss_local = F.cross_entropy(input.to_local(), local_target, ignore_index=ignore_index, reduction="none")
    else:
        vocab_start = _slice_start(input.shape[1], mesh, vocab_axis)
        loss_local = _VocabParallelNLL.apply(
            input.to_local(), local_target, vocab_start, mesh.get_group(vocab_axis), ignore_index
        )
    loss = to_dtensor(loss_local, mesh, rows, target.shape)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    # each rank counts its own rows; the counts are summed where the losses are (one scalar each)
    counted = [Partial() if _splits_rows(p) else Replicate() for p in placements]
    count = to_dtensor((local_target != ignore_index).sum(), mesh, counted, ())
    return total / count


def _applies(input, weight, size_average, reduce, label_smoothing) -> bool:
    if not isinstance(input, DTensor) or input.ndim != 2:
        return False
    if weight is not None or size_average is not None or reduce is not None or label_smoothing:
        return False
    vocab = [m for m, p in enumerate(input.placements) if p == Shard(1)]
    rows = [p for p in input.placements if _splits_rows(p)]
    others_ok = all(p == Shard(1) or _splits_rows(p) or isinstance(p, Replicate) for p in input.placements)
    if not others_ok or len(vocab) > 1 or not (vocab or rows):
        return False
    return not vocab or input.shape[1] % input.device_mesh.size(vocab[0]) == 0


def _splits_rows(p) -> bool:
    """Rows split over an axis, plainly or strided (as flattening `b s/cp` leaves them)."""
    return isinstance(p, (Shard, _StridedShard)) and p.dim == 0


def _slice_start(vocab: int, mesh, axis: int):
    """First vocab index of this rank's slice (a per-rank int under LocalTensorMode)."""
    return mesh.get_coordinate()[axis] * (vocab // mesh.size(axis))


@maybe_run_for_local_tensor  # rank-dependent: runs once per simulated rank
def _shift(target: torch.Tensor, start: int) -> torch.Tensor:
    return target - start

"""Expert parallel: MoE experts split over a mesh axis, tokens sent to their experts and back.

An experts module (HF's `*Experts`, or a user's own with the same call:
`experts(tokens [T, H], expert_ids [T, K], weights [T, K]) -> [T, H]`) holds
its experts packed along dim 0 of every parameter. Laid out `e/ep ...`, each
of the ep ranks holds E/ep experts and, with the tokens split over ep too,
its own tokens. The layouts choose the algorithm (DeepSpeed-MoE's and
torchtitan's): each rank sorts its (token, k) rows by expert, counts them,
exchanges the counts with an all-to-all, sends each row to the rank holding
its expert with an all-to-all of uneven splits, runs its local experts on
what it received (sorted by local expert, the module's own implementation
on plain tensors: HF's eager loop, `grouped_mm` or `batched_mm`, or a user's
`torch._grouped_mm`), sends the results back with the reverse all-to-all and
weighs and sums them per token at home. Nothing is dropped and nothing is
padded: a rank gets exactly the rows routed to its experts (none, if none
are). The backward is autograd's through the same steps, the all-to-alls
reversed.

Tokens replicated over ep (a batch not split over it) are split first, by
a local slice; the result has the tokens' layout on every other axis. The
expert weights' gradients are pending sums over the other axes that split
tokens (data, context, or tensor under sequence parallel): FSDP or
`hp.reduce_gradients` resolves them like any other.

Under `hp.mpmd` (`hp.ops.overlap.chunks()` > 1) the routing is pipelined:
the tokens are cut into that many chunks, one exchange carries every
chunk's counts, every chunk's rows are sent at once, and each chunk's
experts compute while the later chunks' rows are still arriving and the
earlier chunks' results travel back; the backward runs the same pipeline
in reverse (each chunk's gradient comes back while the next chunk's experts
differentiate). The rows sent are the same; only the counts exchange grows,
to one count per expert and chunk.

Every call also counts the (token, k) rows each expert got, for
`expert_loads`: the load balance a trainer reports and balances by.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp.ops import overlap
from hp.ops.collectives import ALL_TO_ALL, all_to_all, issue_all_to_all
from hp.ops.local import local_block, to_dtensor
from hp.simulate import each_rank

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertsError(ValueError):
    """An experts module whose parameters are not laid out for expert parallel."""


def expert_parallel(module: nn.Module, globs: Sequence[str]) -> list[nn.Module]:
    """Run the experts modules of `module` named by `globs` with expert parallel, by their layouts.

    Each matched module's forward becomes `experts_forward` around its own: with DTensor
    parameters, tokens go to the ranks of their experts (an `e/ep` layout) or stay
    (experts replicated) and each rank runs the module's own code on plain tensors; with
    plain parameters it runs as before. Returns the modules matched (`expert_loads` shows one).
    """
    found = [m for n, m in module.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in globs)]
    for experts in found:
        if not getattr(experts, "_hp_expert_parallel", False):
            experts.forward = functools.partial(experts_forward, experts, type(experts).forward)
            experts._hp_expert_parallel = True
    return found


def experts_forward(module: nn.Module, forward: Callable, hidden, expert_ids, weights, *args, **kwargs):
    """`forward(module, hidden, expert_ids, weights)`, run where the layouts of `module`'s parameters say."""
    params = dict(module.named_parameters(recurse=False))
    experts = next(iter(params.values())).shape[0]
    if not all(isinstance(p, DTensor) for p in params.values()):
        counts = _histogram(expert_ids, experts)
        if torch.compiler.is_compiling():  # a compiled block's hook adds them up, outside the graph
            module._hp_counts = counts
        else:
            _count(module, counts)
        return forward(module, hidden, expert_ids, weights, *args, **kwargs)
    mesh = next(iter(params.values())).device_mesh
    axis = _expert_axis(params)
    hidden = _tokens(hidden, mesh, axis)
    expert_ids, weights = (_like(t, hidden) for t in (expert_ids, weights))
    split = [m for m, p in enumerate(hidden.placements) if isinstance(p, (Shard, _StridedShard))]
    local = {name: local_block(p, [m for m in split if m != axis]) for name, p in params.items()}
    run = functools.partial(_run_local, module, forward, tuple(local), args, kwargs)
    x, ids, w = hidden.to_local(), expert_ids.to_local(), weights.to_local()
    counts = _histogram(ids, experts)
    pending = [Partial() if m in split else Replicate() for m in range(mesh.ndim)]  # each rank counted its tokens
    _count(module, DTensor.from_local(counts, mesh, pending, run_check=False))
    if axis is None:
        out = each_rank(run, x, ids, w, *local.values())
    else:
        routed = functools.partial(_run_routed, run, w.dtype)
        rows = route(x, ids, counts, mesh.get_group(axis), lambda r, i: each_rank(routed, r, i, *local.values()))
        out = (rows.view(*ids.shape, -1) * w.unsqueeze(-1)).sum(1).to(x.dtype)
    return to_dtensor(out, mesh, hidden.placements, hidden.shape)


def routes_tokens(module: nn.Module) -> bool:
    """Whether `module` is an experts module laid out as DTensors: its exchanges are sized while the step runs.

    >>> import torch
    >>> routes_tokens(torch.nn.Linear(2, 2))
    False
    """
    return getattr(module, "_hp_expert_parallel", False) and any(
        isinstance(p, DTensor) for p in module.parameters(recurse=False))


LOADS_GROUP = "_hp_loads_group"  # set on a model whose plain experts count their rank's rows: sum over it


def expert_loads(module: nn.Module) -> list[torch.Tensor]:
    """Rows (token, k) each expert got, per experts module of `module`, summed over ranks, since the last call.

    One all-reduce of E counts per experts module over the ranks that split tokens; the
    counts start again from zero. Modules that ran no forward since are left out.

    >>> import torch
    >>> class Experts(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = torch.nn.Parameter(torch.ones(4, 3, 3))
    ...     def forward(self, x, ids, weights):
    ...         return (torch.einsum("th,tkoh->tko", x, self.w[ids]) * weights[..., None]).sum(1)
    >>> moe = torch.nn.ModuleDict({"experts": Experts()})
    >>> _ = expert_parallel(moe, ["experts"])
    >>> _ = moe["experts"](torch.ones(2, 3), torch.tensor([[0, 1], [1, 3]]), torch.ones(2, 2))
    >>> expert_loads(moe)
    [tensor([1, 2, 0, 1])]
    """
    loads = []
    group = getattr(module, LOADS_GROUP, None)  # plain experts under plain data parallel: each rank counted its rows
    for experts in module.modules():
        counted = getattr(experts, "_hp_load", None)
        if counted is not None:
            if isinstance(counted, DTensor):
                counted = counted.full_tensor()
            elif group is not None:
                torch.distributed.all_reduce(counted, group=group)
            loads.append(counted)
            experts._hp_load = None
    return loads


def count_outside_graphs(blocks: Sequence[nn.Module]) -> None:
    """Count the expert loads of compiled `blocks` (plain experts) from each block's forward hook.

    A compiled block's experts keep the counts of their latest call (`_hp_counts`, a graph output
    that dynamo stores after the graph); the block's forward hook, eager outside the graph, adds
    them to the tally once per forward, as the recompute in backward runs the block's forward,
    not its hooks.
    """
    for block in blocks:
        experts = [m for m in block.modules() if getattr(m, "_hp_expert_parallel", False)]
        if experts and not getattr(block, "_hp_counts_outside", False):
            block.register_forward_hook(functools.partial(_add_latest, experts))
            block._hp_counts_outside = True


def _add_latest(experts: list[nn.Module], block: nn.Module, args, output) -> None:
    for module in experts:
        counts = module.__dict__.pop("_hp_counts", None)
        if counts is not None:
            _count(module, counts)


def _histogram(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per expert: `bincount` with a size known before the ids are (one graph holds it)."""
    ids = expert_ids.detach().reshape(-1)
    return torch.zeros(experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def _count(module: nn.Module, counts: torch.Tensor) -> None:
    """Add one call's counts (a DTensor pending its sum over the token axes, or plain) to the module's tally.

    A forward that activation recompute runs again in backward counts nothing: its tokens were counted.
    """
    if torch._C._current_graph_task_id() != -1:
        return
    module._hp_load = counts if getattr(module, "_hp_load", None) is None else module._hp_load + counts


def route(x: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor, group, compute: Compute) -> torch.Tensor:
    """Rows `compute(rows, local_expert_ids)` for each (token, k) of `expert_ids`, on the experts' ranks.

    `x` is [T, H] and `expert_ids` [T, K], this rank's, and `counts` [E] the rows per expert
    among them; the ranks of `group` hold the experts in blocks of E / size. `compute` sees
    the rows each rank received, sorted by local expert id, and returns one row each. The
    result is [T * K, H'], in (token, k) order.
    """
    chunks = min(overlap.chunks(), expert_ids.shape[0])
    if chunks > 1:
        return _Pipelined.apply(x, _Routing(expert_ids, counts.shape[0], group, compute, chunks))
    ranks = group.size()
    local_experts = counts.shape[0] // ranks
    order = torch.argsort(expert_ids.reshape(-1), stable=True)  # rows by expert, so by destination rank
    received = all_to_all(counts, [local_experts] * ranks, [local_experts] * ranks, group)
    send = counts.view(ranks, local_experts).sum(1).tolist()
    recv = received.view(ranks, local_experts).sum(1).tolist()
    rows = _AllToAll.apply(x[order // expert_ids.shape[-1]], recv, send, group)
    # Received rows come by source rank, then by expert: sort them by local expert.
    local_ids = torch.repeat_interleave(torch.arange(local_experts, device=x.device).repeat(ranks), received)
    by_expert = torch.argsort(local_ids, stable=True)
    out = compute(rows[by_expert], local_ids[by_expert])
    back = _AllToAll.apply(out[torch.argsort(by_expert)], send, recv, group)
    return back[torch.argsort(order)]


class _AllToAll(torch.autograd.Function):
    """Rows to every rank of `group` by split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _Routing:
    """Where each chunk of a pipelined routing sends its rows: token ranges, sort orders and split sizes."""

    def __init__(self, expert_ids: torch.Tensor, experts: int, group, compute: Compute, chunks: int) -> None:
        self.group, self.compute, self.k = group, compute, expert_ids.shape[-1]
        ranks = group.size()
        self.local_experts = experts // ranks
        self.ranges = list(torch.arange(expert_ids.shape[0]).tensor_split(chunks))
        ids = [expert_ids[r] for r in self.ranges]
        counts = torch.stack([torch.bincount(i.detach().reshape(-1), minlength=experts) for i in ids])
        # one exchange of every chunk's counts: to each rank, its experts' counts, chunk after chunk
        send = counts.view(chunks, ranks, self.local_experts).transpose(0, 1).reshape(-1)
        block = [chunks * self.local_experts] * ranks
        received = all_to_all(send, block, block, group)
        received = received.view(ranks, chunks, self.local_experts)
        self.orders = [torch.argsort(i.reshape(-1), stable=True) for i in ids]  # rows by expert, so by rank
        self.sends = [c.view(ranks, self.local_experts).sum(1).tolist() for c in counts]
        self.recvs = [received[:, c].sum(-1).tolist() for c in range(chunks)]
        arange = torch.arange(self.local_experts, device=expert_ids.device).repeat(ranks)
        self.local_ids = [torch.repeat_interleave(arange, received[:, c].reshape(-1)) for c in range(chunks)]
        self.by_expert = [torch.argsort(i, stable=True) for i in self.local_ids]

    def dispatch(self, rows: torch.Tensor, c: int) -> torch.Tensor:
        return issue_all_to_all(rows, self.recvs[c], self.sends[c], self.group)

    def combine(self, rows: torch.Tensor, c: int) -> torch.Tensor:
        return issue_all_to_all(rows, self.sends[c], self.recvs[c], self.group)


class _Pipelined(torch.autograd.Function):
    """`route`, chunk by chunk, each chunk's all-to-alls in flight while another chunk's experts run.

    Forward: every chunk's rows are sent at once; each chunk's experts run (their graph kept) as
    soon as its rows land, and its results are sent back at once. Backward: every chunk's result
    gradient is sent at once; each chunk's experts are differentiated as soon as it lands, and its
    row gradients sent home at once. The experts' weights get their gradients from the chunks' graphs.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: _Routing) -> torch.Tensor:
        k = routing.k
        chunks = range(len(routing.ranges))
        sent = [routing.dispatch(x[routing.ranges[c]][routing.orders[c] // k], c) for c in chunks]
        leaves, outs, back = [], [], []
        for c in chunks:
            rows = overlap.wait(sent[c], ALL_TO_ALL).detach().requires_grad_()
            by_expert = routing.by_expert[c]
            with torch.enable_grad():
                out = routing.compute(rows[by_expert], routing.local_ids[c][by_expert])[torch.argsort(by_expert)]
            leaves.append(rows)
            outs.append(out)
            back.append(routing.combine(out.detach(), c))
        ctx.routing, ctx.leaves, ctx.outs, ctx.x = routing, leaves, outs, (x.shape, x.dtype, x.device)
        landed = [overlap.wait(back[c], ALL_TO_ALL)[torch.argsort(routing.orders[c])] for c in chunks]
        return torch.cat(landed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        routing, k = ctx.routing, ctx.routing.k
        chunks = range(len(routing.ranges))
        sizes = [len(r) * k for r in routing.ranges]
        grads = [g[routing.orders[c]] for c, g in zip(chunks, grad.split(sizes))]
        returned = [routing.dispatch(grads[c], c) for c in chunks]  # the combine's way back
        home = []
        for c in chunks:
            torch.autograd.backward(ctx.outs[c], overlap.wait(returned[c], ALL_TO_ALL))
            home.append(routing.combine(ctx.leaves[c].grad, c))  # the dispatch's way back
        shape, dtype, device = ctx.x
        x_grad = torch.zeros(shape, dtype=dtype, device=device)
        for c in chunks:
            rows = routing.ranges[c][0] + routing.orders[c] // k
            x_grad.index_add_(0, rows.to(device), overlap.wait(home[c], ALL_TO_ALL).to(dtype))
        return x_grad, None


def _run_routed(run: Callable, dtype: torch.dtype, rows, local_ids, *params):
    """The local experts on the rows they received: each row routed to one expert with weight 1."""
    ones = torch.ones(rows.shape[0], 1, dtype=dtype, device=rows.device)
    return run(rows, local_ids.unsqueeze(-1), ones, *params)


def _run_local(module: nn.Module, forward: Callable, names: tuple[str, ...], args, kwargs, x, ids, w, *params):
    """The module's own forward on plain tensors: a shallow copy holding this rank's experts."""
    local = object.__new__(type(module))
    local.__dict__.update(module.__dict__)
    local.__dict__["_parameters"] = {}
    local.__dict__.update(zip(names, params))
    if hasattr(module, "num_experts"):
        local.num_experts = params[0].shape[0]
    return forward(local, x, ids, w, *args, **kwargs)


def _expert_axis(params: dict[str, DTensor]) -> int | None:
    """The mesh dim every parameter splits its experts (dim 0) over, or None (experts replicated)."""
    layouts = {name: p.placements for name, p in params.items()}
    axes = {tuple(m for m, pl in enumerate(places) if pl != Replicate()) for places in layouts.values()}
    first = next(iter(params.values()))
    if len(axes) != 1 or len(next(iter(axes))) > 1:
        raise ExpertsError(_wrong(layouts, first, "all be split over one mesh axis along the experts (dim 0), "
                                              "or all be replicated"))
    (split,) = axes
    if not split:
        return None
    axis = split[0]
    if any(places[axis] != Shard(0) for places in layouts.values()):
        raise ExpertsError(_wrong(layouts, first, "be split along the experts, dim 0 (e/ep ...)"))
    if first.shape[0] % first.device_mesh.size(axis):
        raise ExpertsError(_wrong(layouts, first, f"split evenly: {first.shape[0]} experts over "
                                              f"{first.device_mesh.size(axis)} ranks"))
    return axis


def _wrong(layouts, first: DTensor, need: str) -> str:
    from hp.layouts import describe  # noqa: PLC0415  (layouts import ops: describe is needed only here)

    shown = ", ".join(f"{name}: {places}" for name, places in layouts.items())
    return f"the experts' parameters ({shown}; e.g. {describe(first)}) must {need}"


def _tokens(hidden, mesh, axis: int | None) -> DTensor:
    """The tokens as a DTensor split over the expert axis too (a local slice where they were replicated)."""
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if axis is not None and hidden.placements[axis] == Replicate():
        places = list(hidden.placements)
        places[axis] = Shard(0)
        hidden = hidden.redistribute(mesh, places)
    return hidden


def _like(t, hidden: DTensor) -> DTensor:
    """Routing (expert ids or weights) laid out row for row like the tokens."""
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim, run_check=False)
    return t if t.placements == hidden.placements else t.redistribute(hidden.device_mesh, hidden.placements)

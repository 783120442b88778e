"""Expert parallel and the Qwen-MoE plans: loss (with the auxiliary loss), every gradient and the bytes moved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor
from reference import assert_same_loss_and_grads, batch, five_adamw_steps, laid_out_step, rel_err, tiny_pair

import hp
from hp.parallel.expert_balance import ExpertLoad, measure, nudge_routing_bias
from hp.models import plan_for
from hp.ops import overlap
from hp.ops.expert_parallel import ExpertsError, route
from hp.simulate import each_rank

AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.1}  # the Switch loss in the loss, weighed up
STRATEGIES = [
    ("qwen3_moe", {"dp": 2, "ep": 2}), ("qwen3_moe", {"dp": 4, "ep": 4}), ("qwen3_moe", {"dp": 2, "ep": 2, "tp": 2}),
    ("qwen3_moe", {"dp": 2, "ep": 2, "cp": 2}), ("qwen3_moe", {"dp": 2, "ep": 2, "cp": 2, "cp_algorithm": "ring"}),
    ("qwen3_moe", {"tp": 2}), ("qwen2_moe", {"dp": 2, "ep": 2, "tp": 2}), ("qwen2_moe", {"dp": 4, "ep": 2}),
]


def _id(case) -> str:
    family, strategy = case
    return f"{family}-" + "-".join(f"{k}{v}" for k, v in strategy.items())


@pytest.mark.parametrize("family, strategy", STRATEGIES, ids=[_id(c) for c in STRATEGIES])
def test_moe_family_matches_hf_with_its_auxiliary_loss(family, strategy):
    reference, model = tiny_pair(family, **AUX)
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    with laid_out_step(model, strategy, ids, labels) as got:
        assert rel_err(got.aux_loss.full_tensor(), want.aux_loss) < 1e-5
        assert_same_loss_and_grads(got.loss, want.loss, model, reference)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_every_hf_experts_implementation_runs_expert_parallel(implementation):
    reference, model = tiny_pair("qwen3_moe", layers=1, **AUX)
    for m in (reference, model):
        m.set_experts_implementation(implementation)
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    with laid_out_step(model, {"dp": 2, "ep": 2}, ids, labels) as got:
        assert_same_loss_and_grads(got.loss, want, model, reference)


def test_five_adamw_steps_under_ep_and_tp_give_the_same_losses():
    five_adamw_steps("qwen3_moe", {"dp": 2, "ep": 2, "tp": 2}, lr=1e-2, **AUX)


def test_dispatch_and_combine_move_exactly_the_rows_routed_to_other_ranks():
    reference, model = tiny_pair("qwen3_moe", layers=1)
    ids, labels = batch()
    routed = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
    strategy = hp.Strategy(dp=2, ep=2)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        with hp.comm.trace() as t:
            model(input_ids=ids, labels=labels)
        experts = routed[0].full_tensor()._local_tensors[0]
    # Rank 0 holds experts 0-3 and the first half of the batch (tokens in batch-major order).
    home = experts.view(2, -1, experts.shape[-1])
    sent = int((home[0] >= 4).sum())  # rank 0's rows for rank 1's experts
    received = int((home[1] < 4).sum())  # rank 1's rows for rank 0's experts
    row = model.config.hidden_size * 4
    count_exchange = 4 * 8  # half of the 8 int64 counts go to the other rank
    assert t.bytes("all_to_all", axis="ep") == count_exchange + (sent + received) * row
    assert t.count("all_to_all", axis="ep") == 3


class GroupedExperts(torch.nn.Module):
    """Experts written as torchtitan writes them: packed weights, `torch._grouped_mm` over sorted rows."""

    def __init__(self, experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, width) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(experts, width, hidden) * 0.3)

    def forward(self, x, expert_ids, weights):
        tokens, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=self.w1.shape[0]), 0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x[order // k], self.w1, offs=offs))
        y = torch._grouped_mm(h, self.w2, offs=offs)[torch.argsort(order)]
        return (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)


class MoE(torch.nn.Module):
    def __init__(self, experts: int = 8, hidden: int = 16, width: int = 8, k: int = 2) -> None:
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = GroupedExperts(experts, hidden, width)
        self.k = k

    def forward(self, x):
        weights, expert_ids = torch.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)
        return self.experts(x, expert_ids, weights)


def test_a_users_grouped_mm_moe_runs_expert_parallel_inside_parallelize():
    torch.manual_seed(0)
    reference = MoE()
    model = MoE()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(12, 16)
    reference(x).pow(2).sum().backward()
    mesh = hp.mesh(ep=4, simulate=True)
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, {"experts.w1": "e/ep h i", "experts.w2": "e/ep i h"}, inputs={"": "t/ep h"},
                       experts=["experts"])
        with hp.comm.trace() as t:
            out = model(x)
        out.pow(2).sum().backward()
        hp.reduce_gradients(model)
        assert rel_err(out.full_tensor(), reference(x)) < 1e-5
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
    assert t.count("all_to_all", axis="ep") == 3  # counts, dispatch, combine; nothing gathered
    assert t.count("all_gather") == 0


def _routed(ranks: int, per_rank: int, tokens: int, k: int, chunks: int, ids: list[torch.Tensor]):
    """`route` on simulated ep ranks against per-token einsums: outputs and gradients checked; (trace, waits)."""
    experts = ranks * per_rank
    torch.manual_seed(0)
    xs = [torch.randn(tokens, 4, requires_grad=True) for _ in range(ranks)]
    w = torch.randn(experts, 4, 3, requires_grad=True)
    want = [torch.einsum("th,tkho->tko", x, w[i]).reshape(tokens * k, 3) for x, i in zip(xs, ids)]
    sum(o.pow(2).sum() for o in want).backward()
    mesh = hp.mesh(ep=ranks, simulate=True)
    # traced too: a rank whose experts get no rows sends back none, and the trace still counts its bytes
    with hp.comm.trace() as trace, hp.simulated(mesh), overlap.pipelined(chunks) as waits:
        x = LocalTensor({r: xs[r].detach() for r in range(ranks)}).requires_grad_(True)
        local_w = LocalTensor({r: w.detach()[r * per_rank:(r + 1) * per_rank] for r in range(ranks)})
        local_w.requires_grad_(True)
        expert_ids = LocalTensor(dict(enumerate(ids)))
        counts = torch.bincount(expert_ids.reshape(-1), minlength=experts)
        mine = lambda rows, local, w_: torch.einsum("rh,rho->ro", rows, w_[local])  # noqa: E731
        out = route(x, expert_ids, counts, mesh.get_group("ep"), lambda rows, local: each_rank(mine, rows, local, local_w))
        out.pow(2).sum().backward()
        for r in range(ranks):
            assert torch.allclose(out._local_tensors[r], want[r], atol=1e-6)
            assert torch.allclose(x.grad._local_tensors[r], xs[r].grad, atol=1e-5)
            assert torch.allclose(local_w.grad._local_tensors[r], w.grad[r * per_rank:(r + 1) * per_rank], atol=1e-5)
    return trace, waits


@settings(max_examples=25, deadline=None)
@given(data=st.data())
@example(data=None)  # every token of every rank to the last rank's experts: the others get none
def test_route_gives_each_row_its_experts_output_and_exact_gradients(data):
    """Plain, and pipelined over chunks as `hp.mpmd` runs it (counts once, then each chunk's rows there and
    back in forward and in backward)."""
    ranks, per_rank, tokens, k, chunks = (2, 2, 3, 2, 1) if data is None else (
        data.draw(st.sampled_from([2, 4])), data.draw(st.integers(1, 3)), data.draw(st.integers(0, 5)),
        data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)))
    experts = ranks * per_rank
    draw_ids = (lambda: [[experts - 1] * k] * tokens) if data is None else (
        lambda: data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k),
                                   min_size=tokens, max_size=tokens)))
    ids = [torch.tensor(draw_ids(), dtype=torch.int64).view(tokens, k) for _ in range(ranks)]
    trace, waits = _routed(ranks, per_rank, tokens, k, chunks, ids)
    used = min(chunks, tokens)
    assert waits.count == {"all_to_all": 1 + 4 * used if used > 1 else 5}
    if data is None:  # rank 0's 6 rows of 4 floats go to rank 1 and come back; counts are int64, 4 per rank
        assert [(r.kind, r.bytes) for r in trace.select(phase="forward")] == [
            ("all_to_all", 16), ("send_recv", 96), ("all_to_all", 0)]


def test_rows_routed_to_their_own_rank_are_not_counted_as_sent():
    # every token of both ranks to expert 0: rank 0 keeps its 6 rows of 4 floats home and sends back
    # rank 1's 6 results of 3 floats
    ids = [torch.zeros(3, 2, dtype=torch.int64) for _ in range(2)]
    trace, _ = _routed(2, 2, 3, 2, 1, ids)
    assert [(r.kind, r.bytes) for r in trace.select(phase="forward")] == [
        ("all_to_all", 16), ("all_to_all", 0), ("all_to_all", 72)]


def test_the_load_is_counted_over_ranks_once_and_the_bias_moves_routing_toward_balance():
    reference, model = tiny_pair("qwen3_moe", layers=1)
    ids, labels = batch()
    strategy = hp.Strategy(dp=2, ep=2, expert_bias_rate=1.0, recompute=True)  # recomputed forwards count nothing
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        loss = model(input_ids=ids, labels=labels).loss
        assert torch.equal(loss.full_tensor(), reference(input_ids=ids, labels=labels).loss.detach())  # zero bias
        loss.backward()
        load = measure(model)
        assert load.total == ids.numel() * model.config.num_experts_per_tok
        assert measure(model) is None  # the count starts again
        nudge_routing_bias(model, load, 1.0)  # a bias this large sends every token to the least loaded experts
        model(input_ids=ids, labels=labels)
        again = measure(model)
    low = [e for e, n in enumerate(load.per_layer[0]) if n < load.total / len(load.per_layer[0])]
    assert set(e for e, n in enumerate(again.per_layer[0]) if n) <= set(low)
    assert ExpertLoad(((4, 4), (6, 2))).imbalance == 1.5


def test_experts_laid_out_over_two_axes_are_refused_with_their_layouts():
    model = MoE(experts=4)
    mesh = hp.mesh(ep=2, tp=2, simulate=True)
    with hp.simulated(mesh), pytest.raises(ExpertsError, match="split over one mesh axis along the experts"):
        hp.parallelize(model, mesh, {"experts.w1": "e/ep h i", "experts.w2": "e/tp i h"}, inputs={"": "t/ep h"},
                       experts=["experts"])
        model(torch.randn(8, 16))


def test_expert_parallel_on_a_dense_model_or_an_uneven_split_is_refused_before_running():
    with torch.device("meta"):
        dense = tiny_pair("llama", layers=1)[0]
        moe = tiny_pair("qwen3_moe", layers=1)[0]
    with pytest.raises(hp.StrategyError, match=r"ep = 2: the model \(llama\) has no experts"):
        hp.check_strategy(dense, {"dp": 2, "ep": 2}, plan_for(moe.config))
    with pytest.raises(hp.StrategyError, match="ep = 3 does not divide num_experts = 8"):
        hp.check_strategy(moe, {"dp": 3, "ep": 3}, plan_for(moe.config))
    with pytest.raises(hp.StrategyError, match="ep = 4 does not divide dp = 2"):
        hp.Strategy(dp=2, ep=4)
    with pytest.raises(hp.PlanError, match="experts entries"):
        hp.parallelize(MoE(), hp.mesh(ep=2, simulate=True), {}, experts=["mlp.experts"])

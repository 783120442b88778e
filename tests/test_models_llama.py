"""hp.models.llama: declarative dp / cp / tp / sp strategies against the unsharded HF model."""

from __future__ import annotations

import pytest
import torch
from test_hf_models import annotate_llama

import hp
from hp.cost import ring_bytes
from hp.models.llama import parallelize_llama, strategy_mesh
from hp.ops.ring_attention import head_tail_order


@pytest.mark.parametrize(
    "strategy",
    [
        {"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "sp": True},
        {"cp": 2}, {"cp": 4}, {"cp": 2, "tp": 2}, {"dp": 2, "cp": 2},
        {"cp": 2, "cp_algorithm": "ring"}, {"cp": 4, "cp_algorithm": "ring"},
        {"cp": 2, "tp": 2, "cp_algorithm": "ring"}, {"dp": 2, "cp": 2, "cp_algorithm": "ring"},
    ],
)
def test_strategy_matches_hf_and_moves_what_megatron_moves(strategy):
    torch.manual_seed(0)
    reference, model = annotate_llama.tiny_model("llama", 2), annotate_llama.tiny_model("llama", 2)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (4, 16))
    labels = ids.clone()
    labels[:, :2] = -100
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    mesh = strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        parallelize_llama(model, mesh, strategy)
        layers = hp.comm.trace_each(model.model.layers)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        assert abs(loss.full_tensor().item() - ref_loss.item()) / ref_loss.item() < 1e-5
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert annotate_llama.rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
    dp, cp, tp = (strategy.get(k, 1) for k in ("dp", "cp", "tp"))
    tokens = 4 * 16 // (dp * cp)  # per rank of the data and context axes
    tp_kinds = ["all_gather", "reduce_scatter"] * 2 if strategy.get("sp") else ["all_reduce"] * 2
    if strategy.get("cp_algorithm") == "ring":  # the local K/V block (4 kv heads, head_dim 8) passes cp-1 times
        cp_kinds, cp_bytes = ["send_recv"] * (cp - 1), (cp - 1) * tokens * 2 * 4 // tp * 8 * 4
    else:  # Ulysses moves q, k, v and the output once each: 8 query heads, 4 kv heads, head_dim 8
        cp_kinds = ["all_to_all"] * 4
        cp_bytes = sum(ring_bytes("all_to_all", tokens * heads // tp * 8 * 4, cp) for heads in (8, 4, 4, 8))
    expected = [(k, "cp") for k in cp_kinds] * (cp > 1) + [(k, "tp") for k in tp_kinds] * (tp > 1)
    megatron = 2 * ring_bytes("all_reduce", tokens * 64 * 4, tp)
    for trace in layers:
        forward = trace.select(phase="forward")
        assert [(r.kind, r.axis) for r in forward] == expected
        assert trace.bytes(phase="forward") == cp_bytes * (cp > 1) + megatron * (tp > 1)


@pytest.mark.parametrize("seq", [13, 15])
@pytest.mark.parametrize(
    "strategy",
    [
        {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"}, {"cp": 4, "cp_algorithm": "ring"}, {"tp": 2, "sp": True},
        {"cp": 2, "tp": 2, "sp": True, "cp_algorithm": "ring"},
    ],
)
def test_sequences_not_divisible_by_the_chunk_count_are_padded_without_changing_the_numbers(strategy, seq):
    torch.manual_seed(0)
    reference, model = annotate_llama.tiny_model("llama", 1), annotate_llama.tiny_model("llama", 1)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (2, seq))
    labels = ids.clone()
    labels[0, -3:] = -100
    out = reference(input_ids=ids, labels=labels)
    out.loss.backward()
    mesh = strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        parallelize_llama(model, mesh, strategy)
        got = model(input_ids=ids, labels=labels)
        got.loss.backward()
        assert abs(got.loss.full_tensor().item() - out.loss.item()) / out.loss.item() < 1e-5
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert annotate_llama.rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
        logits = got.logits.full_tensor()
    ring = strategy.get("cp_algorithm") == "ring"
    chunks = strategy.get("cp", 1) * (2 if ring else 1) * (strategy["tp"] if strategy.get("sp") else 1)
    padded = seq + (-seq % chunks)
    assert logits.shape[1] == padded
    if ring:  # logits come back in head-tail order
        logits = logits[:, torch.argsort(head_tail_order(padded, strategy["cp"]))]
    assert annotate_llama.rel_err(logits[:, :seq], out.logits) < 1e-5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_mask": torch.tensor([[1] * 8, [0] * 2 + [1] * 6])}, "padding masks are not supported under context"),
        ({"position_ids": torch.arange(8)[None]}, "position_ids are not supported under context parallelism"),
    ],
)
def test_cp_refuses_masks_and_positions_it_cannot_honour(kwargs, message):
    model = annotate_llama.tiny_model("llama", 1)
    mesh = strategy_mesh({"cp": 2, "cp_algorithm": "ring"}, simulate=True)
    with hp.simulated(mesh):
        parallelize_llama(model, mesh, {"cp": 2, "cp_algorithm": "ring"})
        with pytest.raises(ValueError, match=message):
            model(input_ids=torch.zeros(2, 8, dtype=torch.long), **kwargs)


def test_unknown_strategy_keys_and_algorithms_are_refused():
    with pytest.raises(ValueError, match=r"strategy keys \['pp'\] are not supported"):
        strategy_mesh({"tp": 2, "pp": 2}, simulate=True)
    with pytest.raises(ValueError, match=r"strategy cp_algorithm 'star' is not one of \('ulysses', 'ring'\)"):
        strategy_mesh({"cp": 2, "cp_algorithm": "star"}, simulate=True)
    with pytest.raises(ValueError, match=r"strategy fsdp with cp > 1 is not supported yet"):
        strategy_mesh({"dp": 2, "cp": 2, "fsdp": True}, simulate=True)


@pytest.mark.parametrize(
    "strategy",
    [{"tp": 2}, {"dp": 2, "tp": 2}, {"cp": 2, "tp": 2, "sp": False}, {"dp": 2, "cp": 2}, {"cp": 2, "cp_algorithm": "ring"}],
)
def test_five_adamw_steps_give_the_same_losses(strategy):
    from hp.models.llama import reduce_gradients

    torch.manual_seed(0)
    reference, model = annotate_llama.tiny_model("llama", 1), annotate_llama.tiny_model("llama", 1)
    model.load_state_dict(reference.state_dict())
    batches = [torch.randint(0, 256, (4, 16)) for _ in range(5)]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    want = []
    for ids in batches:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    mesh = strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        parallelize_llama(model, mesh, strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        got = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            reduce_gradients(model)
            opt.step()
            opt.zero_grad()
            got.append(loss.full_tensor().item())
    assert got == pytest.approx(want, rel=1e-5)

"""What the zoo tests share: a pair of identical tiny HF models, and the expected collectives.

One model of the pair stays on one device (the reference: HF's code,
unsharded), the other is laid out by a strategy; both start from the same
weights. The expected forward collectives of a decoder layer follow from the
tiny shapes of `hp.models.tiny` (hidden 64, head_dim 8) and the ring byte
model of `hp.cost`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hp
from hp.cost import ring_bytes
from hp.explain import Explanation
from hp.models import plan_for, tiny_config
from hp.parallel.strategy import Strategy

BATCH, SEQ = 4, 16


def tiny_pair(model_type: str, layers: int = 2, **overrides):
    """(reference, model): two HF models of `model_type` with the same weights."""
    torch.manual_seed(0)
    config = tiny_config(model_type, layers=layers, **overrides)
    reference = AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def explained_loss(family: str, strategy: dict, layers: int = 1) -> tuple[float, float, Explanation]:
    """(HF's loss, the laid-out model's loss, `hp.explain`'s records of its forward) on one batch."""
    reference, model = tiny_pair(family, layers=layers)
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss.item()
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        report = hp.explain(lambda: model(input_ids=ids, labels=labels).loss)
        got = report.result.full_tensor().item()
    return want, got, report


@contextmanager
def laid_out_step(model, strategy: dict | Strategy, ids: torch.Tensor, labels: torch.Tensor,
                  traces: list | None = None) -> Iterator:
    """Lay `model` out by `strategy` on simulated ranks, run forward and backward; yields the output there.

    The gradients' pending sums are resolved (`hp.reduce_gradients`), as a training step would. Given
    `traces`, each decoder layer's collectives are traced into it (`hp.comm.trace_each`).
    """
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        layers = hp.comm.trace_each(model.model.layers) if traces is not None else []
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        hp.reduce_gradients(model)
        if traces is not None:
            traces += layers  # filled as the layers ran
        yield out


def five_adamw_steps(family: str, strategy: dict, lr: float = 1e-3, **overrides) -> None:
    """5 AdamW steps of a one-layer `family` under `strategy` give HF's losses."""
    reference, model = tiny_pair(family, layers=1, **overrides)
    batches = [dict(zip(("input_ids", "labels"), batch(seed=s))) for s in range(5)]
    adamw_steps_follow(reference, model, batches, strategy, lr)


def adamw_steps_follow(reference, model, batches: list[dict], strategy: dict, lr: float = 1e-3) -> None:
    """An AdamW step per batch (the forward's keywords) gives `reference`'s losses on `model` laid out by
    `strategy` on simulated ranks (the same weights to start with)."""
    opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    want = []
    for inputs in batches:
        loss = reference(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        got = []
        for inputs in batches:
            loss = model(**inputs).loss
            loss.backward()
            hp.reduce_gradients(model)
            opt.step()
            opt.zero_grad()
            got.append(loss.full_tensor().item())
    assert max(abs(g - w) / w for g, w in zip(got, want)) < 1e-5, (got, want)


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """Relative error in the 2-norm; `floor` bounds the reference's norm from below (a gradient that is zero
    in exact arithmetic is then measured against it, not against its own rounding noise)."""
    err = (got - want).norm() / want.norm().clamp_min(floor)
    if isinstance(err, LocalTensor):  # a gradient left whole on every simulated rank: each rank's own error
        return max(float(e) for e in err._local_tensors.values())
    return float(err)


def assert_same_loss_and_grads(loss, want, model, reference, floor: float = 1e-30) -> None:
    """The laid-out model's loss and every gradient equal the reference's (fp32: relative 1e-5).

    A parameter the batch never reaches (no reference gradient) is skipped.
    """
    assert abs(loss.full_tensor().item() - want.item()) / want.item() < 1e-5
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        if r.grad is not None:
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert rel_err(got, r.grad, floor) < 1e-5, name


def batch(vocab: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) with ignored positions, spread unevenly over the batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    labels[0, 2:7] = -100
    return ids, labels


def expected_layer_collectives(strategy: Strategy, config) -> tuple[list[tuple[str, str]], int]:
    """([(kind, axis)] of one decoder layer's forward, their bytes per rank), Megatron's and CP's."""
    tokens = BATCH * SEQ // (strategy.dp * strategy.cp)  # per rank of the data and context axes
    tp, cp, head_dim = strategy.tp, strategy.cp, 8
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    attention, total = [], 0
    if cp > 1 and strategy.ring:  # the local K/V block passes cp-1 times
        attention = [("send_recv", "cp")] * (cp - 1)
        total += (cp - 1) * tokens * 2 * kv_heads // tp * head_dim * 4
    elif cp > 1:  # Ulysses moves q, k, v and the output once each
        attention = [("all_to_all", "cp")] * 4
        total += sum(ring_bytes("all_to_all", tokens * n // tp * head_dim * 4, cp) for n in (heads, kv_heads, kv_heads, heads))
    if tp == 1:
        return attention, total
    total += 2 * ring_bytes("all_reduce", tokens * config.hidden_size * 4, tp)  # Megatron: 2 all-reduces' bytes
    if strategy.sequence_parallel:  # each block gathers its input and scatters its output
        gather, scatter = ("all_gather", "tp"), ("reduce_scatter", "tp")
        return [gather, *attention, scatter, gather, scatter], total
    return [*attention, ("all_reduce", "tp"), ("all_reduce", "tp")], total

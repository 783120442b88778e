"""Activation recompute (`hp.Strategy(recompute=True)`): the same numbers, each block run again in backward.

On simulated ranks, against HF's unsharded model: loss and every gradient of
Llama and Phi-3 under tp, tp+sp, cp Ulysses, cp ring and dp+tp (and Gemma-2's
eager attention under Ulysses); each block's attention and MLP run twice per
step; each layer's forward collectives are those without recompute, and
backward runs them again; the blocks save only their inputs for backward;
parameter names and state_dict keys are the model's own; dropout draws the
same masks in the recompute; nothing is recomputed without gradients. FSDP2
with recompute runs on real gloo processes only (tests/workers/zoo_gloo.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from reference import assert_same_loss_and_grads, batch, expected_layer_collectives, rel_err, tiny_pair

import hp
from hp.models import plan_for
from hp.parallel.recompute import is_recomputed

STRATEGIES = [{"tp": 2}, {"tp": 2, "sp": True}, {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"}, {"dp": 2, "tp": 2}]
CASES = [(f, s) for f in ("llama", "phi3") for s in STRATEGIES] + [("gemma2", {"cp": 2})]


def _ids(cases) -> list[str]:
    return [f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for f, s in cases]


def _apply(model, strategy: dict, recompute: bool = True):
    """(strategy, mesh) of `strategy` with `recompute`, applied to `model`; call inside `hp.simulated(mesh)`."""
    strategy = hp.Strategy.of({**strategy, "recompute": recompute})
    return strategy, hp.strategy_mesh(strategy, simulate=True)


def _count_block_runs(model) -> list[Counter]:
    """Per layer, how often its attention and MLP start (forward pre-hooks: the layer's own hooks run
    once per step by design, and the recompute stops after the last tensor backward needs)."""
    counts = [Counter() for _ in model.model.layers]
    for count, layer in zip(counts, model.model.layers):
        for name in ("self_attn", "mlp"):
            getattr(layer, name).register_forward_pre_hook(lambda mod, args, c=count, n=name: c.update([n]))
    return counts


@pytest.mark.parametrize("family, strategy", CASES, ids=_ids(CASES))
def test_recompute_matches_hf_and_runs_each_block_again_in_backward(family, strategy):
    reference, model = tiny_pair(family, layers=1)
    ids, labels = batch()
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    strategy, mesh = _apply(model, strategy)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        runs = _count_block_runs(model)
        layers = hp.comm.trace_each(model.model.layers)
        loss = model(input_ids=ids, labels=labels).loss
        assert runs == [Counter(self_attn=1, mlp=1)] * len(runs)
        loss.backward()
        assert_same_loss_and_grads(loss, ref_loss, model, reference)
    assert runs == [Counter(self_attn=2, mlp=2)] * len(runs)
    kinds, total = expected_layer_collectives(strategy, model.config)
    assert len(layers) == len(model.model.layers)  # the layers' hooks (and their traces) run once per step
    for trace in layers:
        assert [(r.kind, r.axis) for r in trace.select(phase="forward")] == kinds
        assert trace.bytes(phase="forward") == total


def _one_step(strategy: dict, recompute: bool) -> tuple[list[tuple], list[tuple]]:
    """([(kind, axis, bytes)] of the layer's forward, of the whole backward) of a 1-layer Llama step."""
    _, model = tiny_pair("llama", layers=1)
    ids, labels = batch()
    strategy, mesh = _apply(model, strategy, recompute)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        layers = hp.comm.trace_each(model.model.layers)
        loss = model(input_ids=ids, labels=labels).loss
        with hp.comm.trace() as backward:
            loss.backward()
    (layer,) = layers
    return _as_tuples(layer.select(phase="forward")), _as_tuples(backward.select(phase="backward"))


def _as_tuples(records) -> list[tuple]:
    return [(r.kind, r.axis, r.bytes) for r in records]


@pytest.mark.parametrize("strategy", [{"tp": 2, "sp": True}, {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"}],
                         ids=["tp2-sp", "cp2", "cp2-ring"])
def test_backward_runs_the_forward_collectives_again(strategy):
    forward, backward = _one_step(strategy, recompute=False)
    forward_again, backward_again = _one_step(strategy, recompute=True)
    assert forward_again == forward
    added, removed = Counter(backward_again) - Counter(backward), Counter(backward) - Counter(backward_again)
    assert not removed
    # The recompute stops at the last tensor backward needs (checkpoint's early stop): under tp that
    # leaves out the MLP's closing reduction, whose result nothing saves.
    assert added == Counter(forward[:-1] if "tp" in strategy else forward)


def _saved_in_blocks(model, ids, labels) -> list[bool]:
    """For each tensor the decoder layers save for backward in one forward, whether it is a layer's input."""
    inside, inputs, saved = [False], [], []

    def enter(mod, args):
        inside[0] = True
        inputs.append(args[0])

    def leave(mod, args, out):
        inside[0] = False

    def pack(t):
        if inside[0] and t.numel():  # torch 2.11's checkpoint also saves an empty placeholder: it holds nothing
            saved.append(any(t is x for x in inputs))
        return t

    for layer in model.model.layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=labels)
    return saved


def test_blocks_save_only_their_inputs_and_keep_their_names():
    _, plain = tiny_pair("llama")
    _, model = tiny_pair("llama")
    ids, labels = batch()
    strategy, mesh = _apply(model, {"tp": 2})
    with hp.simulated(mesh):
        hp.apply_strategy(plain, mesh, {"tp": 2}, plan_for(plain.config))
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        assert len(_saved_in_blocks(plain, ids, labels)) > 20
        assert _saved_in_blocks(model, ids, labels) == [True] * len(model.model.layers)  # each its input only
    assert all(is_recomputed(layer) for layer in model.model.layers)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]


def test_dropout_draws_the_same_masks_in_the_recompute():
    grads = {}
    for recompute in (False, True):
        _, model = tiny_pair("llama", layers=1, attention_dropout=0.5)
        model.train()
        ids, labels = batch()
        strategy, mesh = _apply(model, {"tp": 2}, recompute)
        with hp.simulated(mesh):
            hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
            assert is_recomputed(model.model.layers[0]) == recompute
            torch.manual_seed(5)
            model(input_ids=ids, labels=labels).loss.backward()
            grads[recompute] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, want in grads[False].items():
        assert rel_err(grads[True][name], want) < 1e-6, name


def test_without_gradients_nothing_is_recomputed():
    _, model = tiny_pair("llama", layers=1)
    ids, _ = batch()
    strategy, mesh = _apply(model, {"tp": 2})
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        runs = _count_block_runs(model)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    assert runs == [Counter(self_attn=1, mlp=1)]
    assert not logits.requires_grad


def test_recompute_is_a_strategy_switch_checked_like_the_others():
    assert hp.Strategy.of({"tp": 2, "recompute": True}).recompute
    with pytest.raises(hp.StrategyError, match=r"recompute = 'full': expected true or false"):
        hp.Strategy.of({"recompute": "full"})

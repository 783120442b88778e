"""LoRA on laid-out models: the unsharded LoRA model's loss and adapter gradients, and Megatron's collectives."""

from __future__ import annotations

import pytest
import torch
from reference import batch, expected_layer_collectives, rel_err, tiny_pair

import hp
from hp.parallel.lora import adapter_layouts, has_lora
from hp.models import plan_for

STRATEGIES = [{"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2}, {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"},
              {"cp": 2, "tp": 2}]
CASES = [("llama", s) for s in STRATEGIES] + [("phi3", {"tp": 2}), ("qwen3", {"tp": 2, "sp": True})]


def _lora_pair(family: str, lora: hp.Lora):
    """(reference, model) with the same adapters; B drawn at random so that A's gradients are not zero."""
    reference, model = tiny_pair(family)
    hp.add_lora(reference, lora)
    hp.add_lora(model, lora)
    torch.manual_seed(1)
    for name, param in reference.named_parameters():
        if "lora_" in name:
            param.data.normal_(0, 0.05)
    model.load_state_dict(reference.state_dict())
    return reference, model


@pytest.mark.parametrize("family, strategy", CASES, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for f, s in CASES])
def test_lora_matches_the_unsharded_lora_model(family, strategy):
    reference, model = _lora_pair(family, hp.Lora(rank=4, alpha=8, targets=("all",)))
    ids, labels = batch()
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        layers = hp.comm.trace_each(model.model.layers)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        hp.reduce_gradients(model)
        assert abs(loss.full_tensor().item() - ref_loss.item()) / ref_loss.item() < 1e-5
        trained = 0
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (r.grad is None) == (not p.requires_grad), name
            if p.grad is not None:
                assert rel_err(p.grad.full_tensor(), r.grad) < 1e-5, name
                trained += 1
    assert trained == 2 * {"phi3": 4}.get(family, 7) * 2  # A and B of each linear of both layers (Phi-3 fuses q, k, v and gate, up)
    if not strategy.sequence_parallel:  # the adapters add nothing on the activation path
        kinds, total = expected_layer_collectives(strategy, model.config)
        for trace in layers:
            assert [(r.kind, r.axis) for r in trace.select(phase="forward")] == kinds
            assert trace.bytes(phase="forward") == total


def test_adapters_follow_their_base_layouts():
    _, model = _lora_pair("llama", hp.Lora(rank=4))
    mesh = hp.strategy_mesh({"tp": 2}, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, {"tp": 2}, plan_for(model.config))
        attn = model.model.layers[0].self_attn
        assert hp.describe(attn.q_proj.lora_A.weight) == "f32[r=4, in=64]"
        assert hp.describe(attn.q_proj.lora_B.weight) == "f32[out=64/tp, r=4]"
        assert hp.describe(attn.o_proj.lora_A.weight) == "f32[r=4, in=64/tp]"
        assert hp.describe(attn.o_proj.lora_B.weight) == "f32[out=64, r=4]"


def test_adapters_start_as_the_base_model():
    reference, model = tiny_pair("llama")
    hp.add_lora(model, hp.Lora(rank=4, targets=("q_proj", "v_proj"), rslora=True))
    ids, labels = batch()
    assert has_lora(model) and not has_lora(reference)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "lora rank = 0: expected a positive integer"),
    (dict(dropout=1.0), "lora dropout = 1.0"),
    (dict(alpha=-1), "lora alpha = -1"),
    (dict(targets=()), "lora targets = ()"),
])
def test_bad_lora_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(hp.LoraError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hp.Lora(**kwargs)


def test_targets_that_match_nothing_are_refused_by_name():
    _, model = tiny_pair("llama")
    with pytest.raises(hp.LoraError, match=r"lora targets = \('qkv',\) match no nn.Linear of LlamaForCausalLM"):
        hp.add_lora(model, hp.Lora(targets=("qkv",)))
    with pytest.raises(hp.LoraError, match=r"lora extra modules \['score'\] match no module"):
        hp.add_lora(model, hp.Lora(extra=("score",)))
    assert not has_lora(model) and all(p.requires_grad for p in model.parameters())  # left as it was


def test_extra_modules_train_in_full():
    _, model = tiny_pair("llama")
    hp.add_lora(model, hp.Lora(targets=("q_proj",), extra=("lm_head",)))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trains and "model.embed_tokens.weight" not in trains


def test_adapter_layouts_skip_what_is_not_a_matrix():
    assert adapter_layouts({"*.q_proj.bias": "out/tp", "*.experts.gate_up_proj": "e/ep h f"}) == {}

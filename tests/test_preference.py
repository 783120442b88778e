"""The preference objectives on laid-out models: the unsharded computation's loss and gradients, and the formulas."""

from __future__ import annotations

import math

import pytest
import torch
from reference import rel_err, tiny_pair

import hp
from hp.models import plan_for
from hp.train.config import Preference
from hp.train.data import collate
from hp.train.objectives import VALUE_HEAD, Dpo, Kto, Reference, Reward

STRATEGIES = {"tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sp": True}, "cp2": {"cp": 2},
              "cp2-ring": {"cp": 2, "cp_algorithm": "ring"}, "dp2": {"dp": 2}, "dp2-tp2": {"dp": 2, "tp": 2}}


def _examples(pairs: int, seed: int = 0) -> list[dict]:
    """Prompts and answers of uneven lengths as token ids, the prompts unsupervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(pairs):
        prompt = torch.randint(0, 256, (3 + i,), generator=g).tolist()
        chosen = torch.randint(0, 256, (4 + 2 * i,), generator=g).tolist()
        rejected = torch.randint(0, 256, (6 - i,), generator=g).tolist()
        masked = [-100] * len(prompt)
        out.append({"chosen_ids": prompt + chosen, "chosen_labels": masked + chosen,
                    "rejected_ids": prompt + rejected, "rejected_labels": masked + rejected})
    return out


def _kto_examples(count: int) -> list[dict]:
    pairs = _examples(count, seed=1)
    return [{"input_ids": e["chosen_ids"], "labels": e["chosen_labels"], "kl_input_ids": e["rejected_ids"],
             "kl_labels": e["rejected_labels"], "kto_tag": i % 3 != 1} for i, e in enumerate(pairs)]


def _models(lora: bool = False, value_head: bool = False):
    """(reference policy, policy to lay out, frozen reference, its copy to lay out): policies moved off the reference."""
    policy_ref, policy = tiny_pair("llama")
    frozen_ref, frozen = tiny_pair("llama")
    if lora:
        for m in (policy_ref, policy):
            hp.add_lora(m, hp.Lora(rank=4, targets=("q_proj", "v_proj", "down_proj")))
    if value_head:
        for m in (policy_ref, policy):
            setattr(m, VALUE_HEAD, torch.nn.Linear(m.config.hidden_size, 1))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in policy_ref.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)  # a policy that has moved: rewards are not all zero
    policy.load_state_dict(policy_ref.state_dict())
    for m in (frozen_ref, frozen):
        m.requires_grad_(False)
    return policy_ref, policy, frozen_ref, frozen


def _objective(stage: str, pref: Preference, policy, frozen, strategy, lora: bool):
    reference = Reference(policy, adapters=True) if lora else Reference(frozen)
    if stage == "dpo":
        return Dpo(policy, reference, strategy, pref)
    if stage == "kto":
        return Kto(policy, reference, strategy, pref)
    return Reward(policy, strategy)


def _compare(stage: str, strategy: dict, pref: Preference = Preference(), *, lora: bool = False) -> dict:
    """The laid-out run's loss, gradients and metrics against the unsharded run's; returns the metrics."""
    examples = _kto_examples(4) if stage == "kto" else _examples(2)
    batch = collate(examples, pad_id=0)
    policy_ref, policy, frozen_ref, frozen = _models(lora, value_head=stage == "rm")
    plain = hp.Strategy()
    want = _objective(stage, pref, policy_ref, frozen_ref, plain, lora)(batch, "cpu")
    want.loss.backward()
    strategy = hp.Strategy.of(strategy)
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        for model in (policy, frozen):
            hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        got = _objective(stage, pref, policy, frozen, strategy, lora)(batch, "cpu")
        got.loss.backward()
        hp.reduce_gradients(policy)
        assert abs(float(got.loss) - float(want.loss)) <= 1e-5 * abs(float(want.loss)), (got.loss, want.loss)
        trained = 0
        for (name, p), r in zip(policy.named_parameters(), policy_ref.parameters()):
            assert (p.grad is None) == (r.grad is None), name
            if r.grad is not None and r.grad.abs().max() > 0:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert rel_err(grad, r.grad) < 1e-5, name
                trained += 1
        assert trained > 0
    for key, value in want.metrics.items():
        assert math.isclose(got.metrics[key], value, rel_tol=1e-5, abs_tol=1e-6), key
    return want.metrics


@pytest.mark.parametrize("strategy", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_dpo_matches_the_unsharded_computation(strategy):
    metrics = _compare("dpo", strategy)
    assert set(metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}


@pytest.mark.parametrize("loss", ["hinge", "ipo", "simpo", "orpo"])
def test_each_dpo_loss_matches_the_unsharded_computation(loss):
    _compare("dpo", {"tp": 2}, Preference(loss=loss, ftx=0.5, label_smoothing=0.1))


@pytest.mark.parametrize("strategy", ["tp2", "cp2-ring", "dp2"])
def test_kto_matches_the_unsharded_computation(strategy):
    metrics = _compare("kto", STRATEGIES[strategy], Preference(ftx=0.3, kto_rejected_weight=1.5))
    assert metrics["kl"] >= 0


@pytest.mark.parametrize("strategy", ["tp2-sp", "cp2-ring", "dp2-tp2"])
def test_a_reward_model_matches_the_unsharded_computation(strategy):
    _compare("rm", STRATEGIES[strategy])


@pytest.mark.parametrize("strategy", ["tp2", "cp2"])
def test_dpo_with_lora_reads_the_base_as_its_reference(strategy):
    _compare("dpo", STRATEGIES[strategy], lora=True)

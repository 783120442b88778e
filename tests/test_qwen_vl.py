"""Qwen-VL in the zoo: the laid-out model's loss and every gradient, vision tower included, equal HF's.

Batches mix samples with no image, one, and two of different sizes
(`hp.models.tiny_vl_batch`). The M-RoPE positions are computed once by HF's
own `get_rope_index` on the whole batch and passed to both models: the
simulated ranks (`LocalTensorMode`) cannot run that function's
`torch.tensor(list of tensors)`, which real processes run as HF does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

import hp
from hp.models import plan_for, tiny_config, tiny_vl_batch
from hp.strategy import StrategyError
from tests.reference import rel_err

def vl_pair(family: str, layers: int = 2):
    torch.manual_seed(0)
    config = tiny_config(family, layers=layers)
    reference = AutoModelForImageTextToText.from_config(config)
    model = AutoModelForImageTextToText.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("strategy", [{"tp": 2}, {"tp": 2, "sp": True}], ids=["tp", "tp_sp"])
def test_laid_out_vl_models_give_hfs_loss_and_gradients_with_images(family, strategy):
    reference, model = vl_pair(family)
    batch = tiny_vl_batch(reference, seq=32)
    want = reference(**batch).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        loss = model(**batch).loss
        loss.backward()
        hp.reduce_gradients(model)
        assert abs(_local(loss).item() - want.item()) / want.item() < 1e-5
        grads = {name: _local(p.grad) for name, p in model.named_parameters()}
        # the decoder is split over tp, the vision tower is not
        assert "/tp" in hp.describe(model.model.language_model.layers[0].self_attn.q_proj.weight)
        assert "/tp" not in hp.describe(model.model.visual.blocks[0].attn.qkv.weight)
    assert any(name.startswith("model.visual.") for name in grads)
    for name, r in reference.named_parameters():
        assert rel_err(grads[name], r.grad) < 1e-5, name


def test_five_adamw_steps_of_qwen2_5_vl_under_tp_and_sp_follow_hf():
    reference, model = vl_pair("qwen2_5_vl", layers=1)
    batches = [tiny_vl_batch(reference, seq=32, seed=s) for s in range(5)]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    want = []
    for batch in batches:
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    strategy = {"tp": 2, "sp": True}
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        got = []
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            hp.reduce_gradients(model)
            opt.step()
            opt.zero_grad()
            got.append(_local(loss).item())
    assert max(abs(g - w) / w for g, w in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.parametrize("strategy, axis", [({"dp": 2}, "dp"), ({"cp": 2}, "cp"), ({"dp": 2, "ep": 2}, "ep")])
def test_splitting_a_vl_models_batch_or_sequence_is_refused_by_name(strategy, axis):
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_config("qwen3_vl_moe"))
    with pytest.raises(StrategyError, match=f"{axis} = 2: vision-language models do not split"):
        hp.check_strategy(model, strategy, plan_for(model.config))


def test_hp_train_refuses_a_vl_model_before_any_worker_starts():
    from hp.strategy import Strategy
    from hp.train.config import ConfigError
    from hp.train.model import check_fits

    with pytest.raises(ConfigError, match="qwen2_5_vl is a vision-language model, which hp train does not read images"):
        check_fits(tiny_config("qwen2_5_vl"), Strategy(tp=2))

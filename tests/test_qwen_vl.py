"""Qwen-VL in the zoo: the laid-out model's loss and every gradient, vision tower included, equal HF's.

Under tp and sp, data parallel, context parallel (ring, and Ulysses with tp)
and expert parallel; FSDP and HF's own positions run on real processes in
test_gloo.py.

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
from hp.parallel.strategy import StrategyError
from tests.reference import adamw_steps_follow, rel_err

def vl_pair(family: str, layers: int = 2):
    torch.manual_seed(0)
    config = tiny_config(family, layers=layers)
    reference = AutoModelForImageTextToText.from_config(config)
    model = AutoModelForImageTextToText.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


TP, TP_SP = {"tp": 2}, {"tp": 2, "sp": True}
DP, DP_EP = {"dp": 2}, {"dp": 2, "ep": 2}
RING, ULYSSES_TP = {"cp": 2, "cp_algorithm": "ring"}, {"cp": 2, "cp_algorithm": "ulysses", "tp": 2}
VISION_TP = {"vision_tp": True}  # the tower split over tp too
MATRIX = [("qwen2_5_vl", TP), ("qwen2_5_vl", TP_SP), ("qwen2_5_vl", DP), ("qwen2_5_vl", RING),
          ("qwen2_5_vl", {**DP, **TP_SP, **VISION_TP}), ("qwen3_vl", TP_SP), ("qwen3_vl", RING),
          ("qwen3_vl", ULYSSES_TP), ("qwen3_vl", {**RING, **TP, **VISION_TP}), ("qwen3_vl_moe", TP),
          ("qwen3_vl_moe", DP_EP)]


@pytest.mark.parametrize("family, strategy", MATRIX, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in s.items())}"
                                                          for f, s in MATRIX])
def test_laid_out_vl_models_give_hfs_loss_and_gradients_with_images(family, strategy):
    reference, model = vl_pair(family, layers=1)
    batch = tiny_vl_batch(reference, seq=32)
    want = reference(**batch).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
        loss = model(**batch).loss
        loss.backward()
        pending = {hp.layout_of(p.grad).partial for name, p in model.named_parameters()
                   if name.startswith("model.visual.")}
        hp.reduce_gradients(model)
        assert abs(_local(loss).item() - want.item()) / want.item() < 1e-5
        grads = {name: _local(p.grad) for name, p in model.named_parameters()}
        if "tp" in strategy:  # the decoder is split over tp, the vision tower only with vision_tp
            assert "/tp" in hp.describe(model.model.language_model.layers[0].self_attn.q_proj.weight)
        assert ("/tp" in hp.describe(model.model.visual.blocks[0].attn.qkv.weight)) == ("vision_tp" in strategy)
    # the tower's gradients pend over every axis that splits the decoder's input, to be summed once
    assert pending == {hp.Strategy.of(strategy).token_axes}, pending
    assert any(name.startswith("model.visual.") for name in grads)
    for name, r in reference.named_parameters():
        assert rel_err(grads[name], r.grad) < 1e-5, name


def test_five_adamw_steps_of_qwen2_5_vl_under_tp_and_sp_follow_hf():
    reference, model = vl_pair("qwen2_5_vl", layers=1)
    adamw_steps_follow(reference, model, [tiny_vl_batch(reference, seq=32, seed=s) for s in range(5)], TP_SP)


def test_vision_tp_is_refused_for_a_model_without_a_vision_tower():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    with pytest.raises(StrategyError, match="vision_tp = True: the plan of LlamaForCausalLM has no vision tower"):
        hp.check_strategy(model, {"tp": 2, "vision_tp": True}, plan_for(model.config))


@pytest.mark.parametrize("family, strategy", [("qwen3_vl_moe", {"tp": 2}), ("qwen3_moe", {"dp": 2, "ep": 2}),
                                              ("qwen3_moe", {"dp": 2})])
def test_compile_takes_every_plan(family, strategy):
    from transformers import AutoModelForCausalLM

    auto = AutoModelForImageTextToText if "_vl" in family else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(tiny_config(family, layers=1))
    hp.check_strategy(model, {**strategy, "compile": True, "recompute": True}, plan_for(model.config))


def test_blocks_with_routed_experts_compile_around_them_and_recompute_under_checkpoint():
    """Experts laid out as DTensors stay eager (their exchanges are sized while the step runs), and so does the
    router; every other child of the block is a graph; run against eager in tests/workers/compile_gloo.py."""
    from hp.ops.expert_parallel import routes_tokens
    from hp.parallel.compiled import is_compiled
    from hp.parallel.recompute import is_recomputed

    model = AutoModelForImageTextToText.from_config(tiny_config("qwen3_vl_moe", layers=1))
    plan = plan_for(model.config)
    hp.apply_strategy(model, hp.strategy_mesh({"tp": 2}, simulate=True),
                      {"tp": 2, "compile": True, "recompute": True}, plan)
    block = model.get_submodule(plan.blocks)[0]
    experts = [m for m in block.modules() if routes_tokens(m)]
    assert experts and not any(is_compiled(m) for m in experts)
    assert not is_compiled(block) and is_recomputed(block)
    assert is_compiled(block.self_attn) and is_compiled(block.input_layernorm)
    assert not is_compiled(block.mlp.gate)  # the router beside them: the block drops its logits
    assert not any(is_compiled(m) for m in model.get_submodule(plan.vision).modules())

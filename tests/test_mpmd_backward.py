"""`hp.mpmd.backward`: a stage's backward split into its inputs' gradients (B) and its parameters' (W), the
two together exactly the plain backward's, on drawn layer stacks and on a real HF decoder layer."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hp.mpmd.backward import input_gradients


class Tied(nn.Module):
    """One linear layer used twice and its weight once more: a parameter hanging off several path nodes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.linear(x)))
        return self.linear(h) * self.linear.weight.mean()


def _stack(kinds: list[str], width: int) -> nn.Module:
    made = {"linear": lambda: nn.Linear(width, width), "tanh": nn.Tanh, "norm": lambda: nn.LayerNorm(width),
            "tied": lambda: Tied(width), "nobias": lambda: nn.Linear(width, width, bias=False)}
    return nn.Sequential(*(made[k]() for k in kinds))


def _split_equals_plain(module: nn.Module, x: torch.Tensor, call=lambda m, x: m(x)) -> None:
    split = copy.deepcopy(module)
    plain_x, split_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = call(module, plain_x)
    grad = torch.randn_like(out)
    out.backward(grad)
    later = input_gradients(call(split, split_x), grad, [split_x])
    assert all(p.grad is None for p in split.parameters())  # B touched no parameter
    torch.testing.assert_close(split_x.grad, plain_x.grad, rtol=1e-6, atol=1e-7)
    later()
    for (name, want), got in zip(module.named_parameters(), split.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)


@settings(max_examples=15, deadline=None)
@given(kinds=st.lists(st.sampled_from(["linear", "tanh", "norm", "tied", "nobias"]), min_size=1, max_size=5),
       width=st.integers(1, 6), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_a_split_backward_gives_the_plain_backwards_gradients(kinds, width, rows, seed):
    torch.manual_seed(seed)
    _split_equals_plain(_stack(kinds, width), torch.randn(rows, width))


def test_a_real_decoder_layer_split_gives_its_plain_gradients():
    """Two tiny Llama decoder layers (attention, rotary embeddings, a gated MLP, RMS norms)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=8)
    config._attn_implementation = "eager"
    layers, rotary = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(2)), LlamaRotaryEmbedding(config)

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        embeddings = rotary(x, torch.arange(x.shape[1])[None])
        for layer in m:
            x = layer(x, position_embeddings=embeddings)
            x = x[0] if isinstance(x, tuple) else x
        return x

    _split_equals_plain(layers, torch.randn(2, 5, 16), call)


def test_without_an_input_wanting_a_gradient_the_whole_backward_waits():
    """A stage fed no trained input (a first stage) has nothing to send back: all of it is W."""
    layer = nn.Linear(3, 2)
    later = input_gradients(layer(torch.ones(4, 3)).sum(), None, [torch.ones(4, 3)])
    assert layer.weight.grad is None
    later()
    assert torch.equal(layer.weight.grad, torch.full((2, 3), 4.0))


def test_gradients_accumulate_like_autograds():
    """B and W add to a `.grad` already there, as a second plain backward would."""
    layer, x = nn.Linear(2, 2), torch.ones(1, 2, requires_grad=True)
    layer(x).sum().backward()
    before, before_x = layer.weight.grad.clone(), x.grad.clone()
    input_gradients(layer(x).sum(), None, [x])()
    assert torch.equal(layer.weight.grad, 2 * before) and torch.equal(x.grad, 2 * before_x)


def test_a_split_backward_shortens_a_pipelines_plan():
    """Four stages, eight micro-batches, each block's forward, input gradient and weight gradient one unit:
    1F1B's step is (8 + 3) x 3 = 33 units; split, the drain's backwards pass up the pipeline in one unit
    each and the weight gradients fill the gaps they leave, and each W runs after its B on its rank."""
    from hp.mpmd.costs import Costs
    from hp.mpmd.graph import Graph, Program
    from hp.mpmd.schedule import schedule
    from hp.mpmd.simulate import simulate

    steps = {}
    for split in (False, True):
        graph = Graph((Program("lm", (0, 1, 2, 3), split=split),), (), 8)
        costs = Costs({(k, n): 2.0 if k == "B" and not graph.splits(n) else 1.0 for n in graph.nodes() for k in "FBW"})
        plan = schedule(graph, costs)
        steps[split] = simulate(plan, costs).step_seconds
        for rank, actions in plan.actions.items():
            weights = [a for a in actions if a.kind == "W"]
            assert len(weights) == (8 if split and rank else 0)  # stage 0 receives nothing trained: no split
            assert all(actions.index(w) > actions.index(type(w)("B", w.program, w.stage, w.micro)) for w in weights)
    assert steps == {False: 33.0, True: 30.0}


def test_auto_placements_are_compared_as_they_will_run_with_the_backward_split():
    """`choose_reference` and `choose_tower` under `zero_bubble` plan every candidate with the backward split
    (each half of it half the backward's cost), as the chosen one will run: every candidate's step
    shortens."""
    from hp.mpmd.choice import BlockCosts, TowerCosts, choose_reference, choose_tower

    pair = BlockCosts(forward=1.0, backward=2.0, reference=1.0, transfer=0.0)
    whole, split = (choose_reference(pair, world=4, blocks=8, microbatches=8, zero_bubble=zb).steps for zb in (False, True))
    assert whole == {"shared": 66.0, "own": 108.0} and all(split[k] < whole[k] for k in whole)
    tower = TowerCosts(forward=1.0, backward=2.0, tower_forward=3.0, tower_backward=6.0, transfer=0.0)
    whole, split = (choose_tower(tower, world=4, blocks=16, microbatches=8, trains=True, zero_bubble=zb).steps
                    for zb in (False, True))
    assert set(split) == set(whole) and all(split[k] < whole[k] for k in whole)

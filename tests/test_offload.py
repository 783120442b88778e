"""hp.offload: use-definition recording, the planner's budget, and bit-identical training steps."""

from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hp
from hp.offload.plan import plan_offload
from hp.offload.use_def import Recording, SavedTensor
from tests.reference import tiny_pair


def _training(model, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), grads

    return step


def _batches(n: int) -> list[torch.Tensor]:
    # long enough rows that saved activations, not gradients, make most of the step's memory
    return [torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(s)) for s in range(n)]


@pytest.mark.parametrize("budget", [0.75, 0.5, 0.3])
def test_offloaded_llama_steps_are_bit_identical_and_stay_under_the_budget(budget, tmp_path):
    reference, model = tiny_pair("llama", layers=2)
    plain, offloaded = _training(reference), hp.offload(_training(model), budget=budget, modules=[model],
                                                         directory=str(tmp_path))
    for i, ids in enumerate(_batches(4)):
        want_loss, want_grads = plain(ids)
        got_loss, got_grads = offloaded(ids)
        assert torch.equal(got_loss, want_loss), i
        for name, g in want_grads.items():
            assert torch.equal(got_grads[name], g), (i, name)
        if i > 0:  # the first call records; the others run the plan
            plan, run = offloaded.plan(), offloaded.last_run
            assert plan.over_budget_bytes == 0
            assert plan.peak_after <= plan.budget_bytes < plan.peak_before
            assert run.peak_resident_bytes <= plan.budget_bytes  # hp's ledger, measured while running
            assert run.bytes_offloaded == run.bytes_read_back == plan.offloaded_bytes > 0
    assert list(tmp_path.rglob("*.bin")) == []  # every file was read back and removed


def test_compiled_blocks_offload_what_their_graphs_save_and_steps_stay_bit_identical(tmp_path):
    """The recording runs the compiled graphs (its allocation tracker is an infra mode, which dynamo runs
    compiled code under), so every later call saves what it recorded: the plan settles, nothing recompiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    reference, model = tiny_pair("llama", layers=2)
    for m in (reference, model):
        hp.compile_blocks(m.model.layers, backend="aot_eager")
    plain, offloaded = _training(reference), hp.offload(_training(model), budget=0.5, modules=[model],
                                                         directory=str(tmp_path))
    for i, ids in enumerate(_batches(3)):
        want_loss, want_grads = plain(ids)
        got_loss, got_grads = offloaded(ids)
        assert torch.equal(got_loss, want_loss) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
        if i > 0:
            run = offloaded.last_run
            assert offloaded.settled and run.bytes_offloaded == offloaded.plan().offloaded_bytes > 0
    assert counters["stats"]["unique_graphs"] - graphs == 1 and sum(counters["graph_break"].values()) == breaks


def test_optimizer_states_wait_in_the_tier_between_updates_and_steps_stay_bit_identical():
    reference, model = tiny_pair("llama", layers=1)
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model))
    plain, offloaded = _training(reference, ref_opt), hp.offload(_training(model, opt), budget=0.5, modules=[model],
                                                                 optimizer=opt)
    moved = [p for p in model.parameters() if p.numel() * 4 >= 1024]  # smaller states stay
    for i, ids in enumerate(_batches(3)):
        want_loss, want_grads = plain(ids)
        got_loss, got_grads = offloaded(ids)
        assert torch.equal(got_loss, want_loss) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
        # between steps the moments hold no memory here
        assert all(opt.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in moved), i
    assert offloaded.last_run.optimizer_bytes == 2 * 4 * sum(p.numel() for p in moved)
    offloaded.restore_optimizer_states()  # as before saving a checkpoint
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, r)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[r][key])


@pytest.mark.parametrize("bandwidth, recomputed", [(1e12, ()), (1e6, ("model.layers.0", "model.layers.1"))])
def test_the_planner_recomputes_the_blocks_whose_moves_would_cost_more_and_steps_stay_bit_identical(
        bandwidth, recomputed):
    reference, model = tiny_pair("llama", layers=2)
    plain = _training(reference)
    offloaded = hp.offload(_training(model), budget=0.5, modules=[model], recompute=model.model.layers,
                           bandwidth=bandwidth)
    for i, ids in enumerate(_batches(4)):
        want_loss, want_grads = plain(ids)
        got_loss, got_grads = offloaded(ids)
        assert torch.equal(got_loss, want_loss) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items()), i
    plan = offloaded.plan()
    assert offloaded.settled and plan.recompute == recomputed
    assert [hp.parallel.recompute.is_recomputed(layer) for layer in model.model.layers] == [bool(recomputed)] * 2
    assert plan.peak_after <= plan.budget_bytes and offloaded.last_run.peak_resident_bytes <= plan.budget_bytes
    if recomputed:  # planned on the step as it runs now: the blocks keep their inputs, and nothing inside
        inside = [t.defined_in for t in (d.tensor for d in plan.decisions)  # (torch 2.11's checkpoint also
                  if t.defined_in.startswith("model.layers.") and t.nbytes]  # saves an empty placeholder)
        assert sorted(inside) == ["model.layers.0", "model.layers.1"]
        assert "recomputed in backward: model.layers.0, model.layers.1" in plan.table()


class _Spiky(torch.nn.Module):
    """Saves little, but makes a large temporary: recomputed in backward, it holds that there too."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h.repeat(1, 32).view(x.shape[0], 32, 64).mean(1) + x


def test_a_recompute_that_holds_more_than_planned_is_backed_out_and_steps_stay_bit_identical():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Spiky() for _ in range(3)])
    reference = copy.deepcopy(model)

    def training(m):
        def step(x):
            m(x).square().mean().backward()
            grads = [p.grad.clone() for p in m.parameters()]
            m.zero_grad()
            return grads
        return step

    offloaded = hp.offload(training(model), budget=0.7, modules=[model], recompute=list(model), bandwidth=1e5)
    tried = []
    for i in range(4):
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(i))
        assert all(torch.equal(a, b) for a, b in zip(offloaded(x), training(reference)(x))), i
        tried.append(offloaded.plan().recompute)
    assert tried[0] == ("0", "1", "2")  # the estimate leaves out the temporaries a recompute makes again
    assert tried[-1] == () and not any(hp.parallel.recompute.is_recomputed(b) for b in model)  # the recording showed them


def test_the_recording_sees_every_saved_activation_with_its_definition_and_uses(tmp_path):
    reference, model = tiny_pair("llama", layers=1)
    step = hp.offload(_training(model), budget=1.0, modules=[model])
    plan = step.plan(_batches(1)[0])
    recorded = [d.tensor for d in plan.decisions]
    acts = [t for t in recorded if t.kind == "activation"]
    assert acts and all(t.uses and t.uses[0] > t.defined_at for t in acts)
    assert any(t.defined_in.startswith("model.layers.0.mlp") for t in acts)
    weights = {p.untyped_storage().nbytes() for p in model.parameters()}
    assert any(t.kind == "input" and t.nbytes in weights for t in recorded)  # linears keep their weights
    assert plan.peak_after == plan.peak_before  # a budget of the whole peak offloads nothing
    assert {d.action for d in plan.decisions} == {"keep", "input"}
    if importlib.util.find_spec("matplotlib") is not None:  # the `plot` extra
        plan.plot(str(tmp_path / "timeline.png"))
        assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    rows = plan.table().splitlines()
    assert rows[0].split()[:3] == ["#", "bytes", "shape"] and len(rows) == len(recorded) + 2


def _greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The tokens of greedy decoding with HF's cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids, tokens = prompt, []
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(ids)
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_greedy_decoding_with_an_offloaded_kv_cache_gives_the_same_tokens_under_the_budget(budget, tmp_path):
    reference, model = tiny_pair("llama", layers=8)
    prompt = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _greedy(reference, prompt, 12)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    decode = hp.offload(lambda ids: model(input_ids=ids, cache=cache, use_cache=True).logits,
                        budget=budget, kv_cache=cache, directory=str(tmp_path))
    ids, got, peaks = prompt, [], []
    with torch.no_grad():
        for _ in range(12):
            ids = decode(ids)[:, -1:].argmax(-1)
            got.append(ids)
            run = decode.last_run
            peaks.append(run.peak_resident_bytes / run.budget_bytes)
            resident = sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                           for layer in cache.layers)
            assert resident <= run.budget_bytes  # between calls only the kept layers hold memory
            assert run.kept_layers < len(cache.layers) and run.bytes_offloaded > 0
    assert torch.equal(torch.cat(got, dim=1), want)
    assert 0.5 < max(peaks) <= 1.0, peaks  # the budget is used, and kept
    assert cache.get_seq_length() == 24 + 11


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_planner_meets_any_budget_above_the_largest_tensor_it_must_hold(data):
    n = data.draw(st.integers(1, 8))
    sizes = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    # forward saves 0..n-1, backward reads them in reverse: events n..2n-1
    tensors = [SavedTensor(i, b, (b,), torch.uint8, "activation", defined_at=i, defined_in="", uses=[2 * n - 1 - i])
               for i, b in enumerate(sizes)]
    times = sorted(data.draw(st.lists(st.floats(0, 1), min_size=2 * n, max_size=2 * n)))
    recording = Recording(tensors, times, backward_start=n)
    floor = max(sizes)  # the tensor read at an event must be resident then
    budget = data.draw(st.integers(floor, sum(sizes)))
    plan = plan_offload(recording, budget, "disk", bandwidth=data.draw(st.sampled_from([1e3, 1e9])))
    assert plan.peak_after <= max(budget, _needed_at_once(tensors))
    assert plan.peak_before == sum(sizes)


def _needed_at_once(tensors: list[SavedTensor]) -> int:
    """At the first backward event the last-saved tensor is read while the others may be away."""
    return max(t.nbytes for t in tensors)


@pytest.mark.parametrize("kwargs, problem", [
    ({"budget": 0}, "budget=0"),
    ({"budget": -5}, "budget=-5"),
    ({"budget": 1.5}, "at most 1.0"),
    ({"budget": "half"}, "budget='half'"),
    ({"budget": 0.5, "tiers": ("device", "ssd")}, "tiers=('device', 'ssd')"),
    ({"budget": 0.5, "tiers": ("device", "host")}, "host tier is not built yet"),
    ({"budget": 0.5, "kv_cache": [1, 2]}, "kv_cache=list: expected a cache"),
    ({"budget": 0.5, "recompute": [torch.nn.Linear(1, 1)]}, "recompute[0] (Linear) is not a module of `modules`"),
    ({"budget": 0.5, "bandwidth": 0}, "bandwidth=0: expected bytes per second"),
    ({"budget": 0.5, "kv_cache": __import__("transformers").DynamicCache(), "optimizer": torch.optim.SGD(
        [torch.nn.Parameter(torch.ones(1))])}, "give one of them"),
])
def test_bad_offload_requests_are_refused_with_the_problem_named(kwargs, problem):
    with pytest.raises(hp.OffloadError, match=re.escape(problem)):
        hp.offload(lambda: None, **kwargs)


def test_a_step_that_saves_something_else_keeps_it_and_is_planned_again():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))

    def step(x):
        layer(x).square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        return grads

    offloaded = hp.offload(step, budget=0.3, modules=[layer])
    offloaded(torch.ones(8, 16))
    first = offloaded.plan()
    got = offloaded(torch.ones(4, 16))  # other shapes: nothing matches the plan
    want = step(torch.ones(4, 16))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert offloaded.last_run.bytes_offloaded == 0
    offloaded(torch.ones(4, 16))  # recorded anew
    assert offloaded.plan() is not first


def test_offload_of_tp_and_sequence_parallel_llama_blocks_on_two_gloo_processes():
    import re
    from pathlib import Path

    import rank_pool
    from gloo_launch import assert_finished

    run = rank_pool.run(str(Path(__file__).parent / "workers" / "offload_gloo.py"), 2)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1"]

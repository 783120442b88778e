"""`hp.mpmd` levels 2 and 3: graphs of programs, the cost-aware planner, its simulator and the runtime.

The planner and the simulator are pure: hypothesis draws graphs (pipelines, spread sub-models,
programs running ahead), micro-batch counts and costs, and every plan must run every action once, on a
rank it may run on, without deadlock, with a single pipeline's step equal to 1F1B's formula. The
runtime runs drawn plans on gloo ranks (`workers/mpmd_gloo.py`) against the plain step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import rank_pool
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp.mpmd.costs import Costs
from hp.mpmd.graph import Action, Flow, Graph, GraphError, Program
from hp.mpmd.mailbox import Mailbox
from hp.mpmd.plan import replay
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import project, simulate
from hp.parallel.strategy import Strategy

HERE = Path(__file__).resolve().parent
seconds = st.floats(min_value=0.1, max_value=3.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 10), f=seconds, b=seconds)
def test_a_single_pipeline_is_planned_as_1f1b(p, m, f, b):
    """(m + p - 1)(F + B): the step of 1F1B with uniform stages; at most p - s micro-batches held by stage s."""
    graph = Graph((Program("lm", tuple(range(p))),), (), m)
    costs = Costs({(k, n): (f if k == "F" else b) for n in graph.nodes() for k in "FB"})
    plan = schedule(graph, costs)
    assert simulate(plan, costs).step_seconds == pytest.approx((m + p - 1) * (f + b))
    for rank, actions in plan.actions.items():
        held = 0
        for action in actions:
            held += 1 if action.kind == "F" else -1
            assert held <= p - rank, plan


@st.composite
def graphs(draw):
    world = draw(st.integers(1, 4))
    ranks = st.integers(0, world - 1)
    m = draw(st.integers(1, 6))
    lm = Program("lm", tuple(draw(st.lists(ranks, min_size=1, max_size=4))))
    spread = draw(st.booleans())
    enc = Program("enc", tuple(draw(st.lists(ranks, min_size=1, max_size=world, unique=True))), spread=spread,
                  parts=draw(st.sampled_from([1, 2, 3])) if spread else 1)
    ref = Program("ref", tuple(draw(st.lists(ranks, min_size=1, max_size=3))), trains=False,
                  ahead=draw(st.integers(0, 1)))
    flows = (Flow(("enc", 0 if enc.spread else enc.stages - 1), ("lm", 0)), Flow(("ref", ref.stages - 1), ("lm", lm.stages - 1)))
    programs = (enc, lm, ref)
    if draw(st.booleans()):  # a frozen program in the step whose groups of micro-batches each loss gathers
        stat = Program("stat", tuple(draw(st.lists(ranks, min_size=1, max_size=3))), trains=False)
        group = draw(st.sampled_from([g for g in range(1, m + 1) if m % g == 0]))
        programs += (stat,)
        flows += (Flow(("stat", stat.stages - 1), ("lm", lm.stages - 1), gather=group),)
    graph = Graph(programs, flows, m)
    costs = Costs({(k, n): draw(seconds) for n in graph.nodes() for k in "FB"},
                  {(f.src, f.dst): draw(seconds) for f in flows})
    return graph, costs


@settings(max_examples=80, deadline=None)
@given(drawn=graphs())
def test_every_plan_runs_every_action_once_where_it_may_without_deadlock(drawn):
    graph, costs = drawn
    plan = schedule(graph, costs)
    planned = [a for actions in plan.actions.values() for a in actions]
    assert sorted(planned) == sorted(graph.actions())
    assert len(planned) == sum(graph.micros(n) * (2 if graph.trains(n) else 1) for n in graph.nodes())
    for action, rank in plan.where.items():
        assert rank in graph.ranks_of(action.node)
        if action.kind == "B":
            assert plan.where[Action("F", *action.node, action.micro)] == rank  # the activations are there
    slots = {s.action: s for s in replay(plan, costs)}
    for action, slot in slots.items():
        for dep in graph.dependencies(action):
            assert slots[dep].end <= slot.start + 1e-9
    busiest = max(sum(costs.seconds(a) for a in acts) for acts in plan.actions.values())
    assert simulate(plan, costs).step_seconds >= busiest - 1e-9


def test_a_reference_running_ahead_fills_the_policys_bubbles():
    """DPO under pp=4 with 8 micro-batches (forward 1, backward 2, the reference's forward 1). Run before
    the policy's step, the reference's 32 forwards add 8 units to the policy's 1F1B (33); a batch ahead
    they fit its bubbles but for 4 units (2.5 with each pair's chosen and rejected answers apart);
    staggered (stage s a further 3 - s batches ahead, so that none waits on another within a step)
    they all fit."""
    policy = Program("policy", (0, 1, 2, 3))
    unit = {"F": 1.0, "B": 2.0}
    steps = {}
    for ahead, stagger, parts in ((0, False, 1), (1, False, 1), (1, False, 2), (1, True, 1)):
        ref = Program("reference", (0, 1, 2, 3), trains=False, ahead=ahead, stagger=stagger, parts=parts)
        graph = Graph((policy, ref), (Flow(("reference", 3), ("policy", 3)),), 8)
        costs = Costs({(k, n): unit[k] / (parts if n[0] == "reference" else 1) for n in graph.nodes() for k in "FB"})
        steps[ahead, stagger, parts] = simulate(schedule(graph, costs), costs).step_seconds
    assert steps == {(0, False, 1): 41.0, (1, False, 1): 37.0, (1, False, 2): 35.5, (1, True, 1): 33.0}


def test_a_vision_tower_spread_over_the_ranks_beats_the_best_static_split():
    """An encoder worth 2 of an 8-block language model's blocks (20% of a sample's work), 4 ranks, 8
    micro-batches: spread over the ranks and planned by cost it takes 72 units (69 with each micro-batch's
    images cut in two, so that the first and the last micro-batch's tower work is shared by two ranks; in
    four, the parts of a micro-batch on distinct ranks, 67.5: the bound, once the planner has moved the parts
    whose backward it first left to the step's end); the best split of the same ranks with the encoder in
    stage 0 (every split searched) takes 93."""
    lm = Program("lm", (0, 1, 2, 3))
    spread = []
    for parts in (1, 2, 4):
        enc = Program("enc", (0, 1, 2, 3), spread=True, parts=parts)
        graph = Graph((enc, lm), (Flow(("enc", 0), ("lm", 0)),), 8)
        per = {("enc", 0): 2.0 / parts, **{("lm", s): 2.0 for s in range(4)}}
        costs = Costs({(k, n): per[n] * (1 if k == "F" else 2) for n in graph.nodes() for k in "FB"})
        spread.append(simulate(schedule(graph, costs), costs).step_seconds)
    static = []
    for a in range(9):
        for b in range(1, 9 - a):
            for c in range(1, 9 - a - b):
                d = 8 - a - b - c
                if d >= 1:
                    only = Graph((lm,), (), 8)
                    split = {("lm", 0): a + 2.0, ("lm", 1): b, ("lm", 2): c, ("lm", 3): d}
                    cost = Costs({(k, n): split[n] * (1 if k == "F" else 2) for n in only.nodes() for k in "FB"})
                    static.append(simulate(schedule(only, cost), cost).step_seconds)
    assert (spread, min(static)) == ([72.0, 69.0, 67.5], 93.0)


def test_projection_adds_the_gradients_ring_all_reduce():
    graph = Graph((Program("lm", (0, 1)),), (), 4)
    costs = Costs(Costs.unit(graph).compute, param_bytes={("lm", 0): 1e9, ("lm", 1): 3e9})
    plan = schedule(graph, costs)
    sim = simulate(plan, costs)
    at = project(sim, plan, costs, 1024, 10e9)
    assert at.step_seconds == pytest.approx(10.0 + 2 * 511 / 512 * 0.3)
    assert at.idle_share[0] == pytest.approx(1 - 8 / at.step_seconds)


@pytest.mark.parametrize("build, words", [
    (lambda: Graph((Program("a", (0,)),), (Flow(("a", 0), ("b", 0)),), 1), "('b', 0) is no stage of the graph"),
    (lambda: Graph((Program("a", (0,)), Program("b", (1,))), (Flow(("a", 0), ("b", 0)), Flow(("b", 0), ("a", 0))), 1),
     "the flows make a cycle"),
    (lambda: Graph((Program("a", (0, 1), stagger=True),), (), 1), "only a frozen program can be staggered"),
    (lambda: Graph((Program("a", (0,)), Program("b", (1,), ahead=1)), (Flow(("a", 0), ("b", 0)),), 1),
     "a program cannot feed one that runs further ahead"),
    (lambda: Graph((Program("a", (0,)),), (), 0), "microbatches = 0"),
    (lambda: Graph((Program("a", (0,), trains=False, split=True),), (), 1),
     "only a trained program's backward can be split"),
    (lambda: Graph((Program("a", (0,)), Program("b", (1,))), (Flow(("a", 0), ("b", 0), gather=2),), 2),
     "a gathering flow comes from a frozen program in the same step"),
    (lambda: Graph((Program("a", (0,), trains=False), Program("b", (1,))), (Flow(("a", 0), ("b", 0), gather=2),), 3),
     "microbatches = 3 does not cut into groups of gather = 2"),
])
def test_a_graph_that_cannot_run_is_refused_by_name(build, words):
    with pytest.raises(GraphError, match=re.escape(words)):
        build()


PLACE_ERRORS = [
    (dict(place={"model.language_model": "enc"}), "'model.language_model' is no sub-model hp.mpmd can place; "
                                                   "this model's are: 'model.visual' (the vision tower)"),
    (dict(place={"model.visual": "tower"}), "no sub-mesh of that name; mesh names ['enc', 'pp']"),
    (dict(mesh={"enc": (0,)}), "mesh: no 'pp' sub-mesh"),
    (dict(mesh={"enc": (0, 0), "pp": (0,)}), "mesh['enc'] = (0, 0): expected distinct ranks"),
    (dict(plan=None), "place needs the model's plan"),
    (dict(microbatches=0), "microbatches = 0"),
    (dict(chunks=2), "chunks = 2 with place"),
    (dict(place=None, zero_bubble=True), "zero_bubble without place"),
    (dict(strategy=Strategy(cp=2)), "strategy: {'cp': 2} inside placed stages"),
]


@pytest.mark.parametrize("change, words", PLACE_ERRORS)
def test_a_placement_that_cannot_run_is_refused_by_name(change, words):
    """`hp.mpmd(model, place=..., mesh=...)` names what is wrong before any rank works."""
    import torch
    from hp.models import plan_for, tiny_config

    import hp

    config = tiny_config("qwen2_5_vl", layers=2)
    asked = dict(place={"model.visual": "enc"}, mesh={"enc": (0,), "pp": (0,)}, plan=plan_for(config), microbatches=2)
    with pytest.raises(ValueError, match=re.escape(words)):
        hp.mpmd(torch.nn.Linear(1, 1), **(asked | change))  # refused before the model is looked at


def test_a_tensor_the_envelope_cannot_describe_is_refused_by_name():
    """An envelope holds at most 6 dimensions and the dtypes it names: another tensor is refused before
    anything is sent."""
    with pytest.raises(ValueError, match="7 dimensions between stages"):
        Mailbox(None, "cpu").send(torch.zeros([1] * 7), 1, 0)
    with pytest.raises(ValueError, match="a torch.complex64 tensor between stages"):
        Mailbox(None, "cpu").send(torch.zeros(2, dtype=torch.complex64), 1, 0)


@settings(max_examples=1, deadline=None)
@given(cases=st.lists(st.fixed_dictionaries({
    "micro": st.integers(1, 4), "seed": st.integers(0, 2**16), "parts": st.sampled_from([1, 2]),
    "ref_parts": st.sampled_from([1, 2]), "stagger": st.booleans(), "frozen_enc": st.booleans(),
    "enc": st.sampled_from([[0], [1], [0, 1]]), "lm": st.sampled_from([[0, 1], [1, 0], [1, 1], [0, 0]]),
    "ref": st.sampled_from([[0, 1], [1, 0], [1, 1]]), "ahead": st.integers(0, 1), "stat": st.sampled_from([None, 0, 1]),
    "split": st.booleans(), "seconds": st.lists(seconds, min_size=12, max_size=12)}), min_size=4, max_size=4))
def test_plans_run_on_gloo_ranks_give_the_plain_steps_loss_and_gradients(cases):
    """Four drawn cases per run: placements, micro-batches, the reference in the step or a batch ahead,
    each cut into parts or whole, staggered or not, the encoder trained or frozen (then a batch ahead), the
    model's backward whole or split into input and weight gradients,
    a frozen program in the step whose outputs each group of micro-batches' loss gathers, or none,
    and costs (so the planned orders differ); two steps each, planned again from other costs after the
    first. Two more are always the cases with the most to get wrong: the reference a batch ahead,
    staggered, in parts, the encoder spread in parts, trained and frozen, the model's backward split."""
    always = {"micro": 3, "seed": 7, "parts": 2, "ref_parts": 2, "stagger": True, "enc": [0, 1], "lm": [0, 1],
              "ref": [1, 0], "ahead": 1, "stat": 1, "split": True,
              "seconds": [1.0, 2.0, 0.5, 1.0, 1.0, 2.0, 0.6, 0.0, 0.4, 0.0, 0.3, 0.0]}
    both = [always | {"frozen_enc": frozen} for frozen in (False, True)]
    run = rank_pool.run(str(HERE / "workers" / "mpmd_gloo.py"), 2, json.dumps([*cases, *both]), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "mpmd plans follow the plain step" in run.stdout


def test_dpo_with_its_reference_ahead_gives_the_plain_steps_on_gloo_ranks():
    """Level 3 on real models (`hp.mpmd.policy_and_reference`, run by `hp.mpmd.Placed`): a tiny Llama policy
    and its frozen reference, each cut into two pipeline stages over two ranks, the reference's forward
    of the next batch run in this step's gaps, staggered or not: four SGD steps (the last two planned from
    the measured costs) give the plain DPO step's losses and gradients; KTO's likewise, each batch's reference
point gathered from the policy's forward of its mismatched pairs (`workers/mpmd_dpo_gloo.py`)."""
    run = rank_pool.run(str(HERE / "workers" / "mpmd_dpo_gloo.py"), 2, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stagger in (False, True):
        assert f"dpo with its reference ahead (staggered: {stagger}) follows the plain step" in run.stdout
    assert "kto with its reference ahead and its reference point gathered follows the plain step" in run.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_policy_and_reference_with_tp_inside_their_stages_give_the_plain_steps_on_gloo_ranks(ranks):
    """`hp.mpmd.Placed(planes=2)`: both models laid out tp=2 inside their stages (sequence parallel when cut in
    two), the ranks two tensor parallel planes of the placement, DPO and KTO against the plain step of
    unsharded models: losses and whole gradients over three steps, the last planned from the costs every
    plane agreed on (`workers/mpmd_tp_gloo.py`)."""
    run = rank_pool.run(str(HERE / "workers" / "mpmd_tp_gloo.py"), ranks, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in ("dpo", "kto"):
        assert f"{stage} with tp inside {ranks // 2} stage(s) follows the plain step" in run.stdout


def test_a_qwen_vl_tower_placed_by_hp_mpmd_gives_hfs_steps_on_gloo_ranks():
    """Level 2 on a real model through `hp.mpmd(model, place=..., mesh=...)`: a tiny Qwen2.5-VL's vision
    tower spread over the pipeline's two ranks (the language model's backward split), on a rank of its own, frozen a batch ahead, and laid out tp=2
    (sp) with a one-stage language model over the two ranks (two planes); three SGD
    steps (the last planned from the measured costs) give HF's loss and every gradient, the tower's included
    (`workers/mpmd_vl_gloo.py`)."""
    run = rank_pool.run(str(HERE / "workers" / "mpmd_vl_gloo.py"), 2, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for placement in ("in the pipeline's bubbles, the backward split", "on a rank of its own", "frozen, a batch ahead in the pipeline's bubbles",
                      "laid out tp=2 beside its language model"):
        assert f"a vision tower {placement} follows HF's step" in run.stdout


@settings(max_examples=25, deadline=None)
@given(forward=st.floats(0.1, 2.0), backward=st.floats(0.1, 4.0), reference=st.floats(0.05, 2.0),
       transfer=st.floats(0.0, 6.0), world=st.integers(1, 4), blocks=st.integers(4, 9), micro=st.integers(1, 8),
       kto=st.booleans(), zero_bubble=st.booleans())
def test_the_reference_goes_where_the_replayed_plan_is_shorter(forward, backward, reference, transfer, world, blocks,
                                                              micro, kto, zero_bubble):
    """`hp.mpmd.choice.choose_reference`: the policy over every rank with its reference in the bubbles, or over
    half with the reference on the other half, whichever's plan replays shorter; no step beats the work
    spread evenly over the ranks. KTO's (one reference point a step) trains on one row of each pair and
    runs the other without gradient. With `zero_bubble` each way is planned with the policy's backward split."""
    from hp.mpmd.choice import BlockCosts, choose_reference

    choice = choose_reference(BlockCosts(forward, backward, reference, transfer), world=world, blocks=blocks,
                              microbatches=micro, reference_point=micro if kto else 0, zero_bubble=zero_bubble)
    assert set(choice.steps) == ({"shared", "own"} if world % 2 == 0 else {"shared"})
    assert choice.steps[choice.where] == min(choice.steps.values())
    work = (forward + backward + 3 * reference) / 2 if kto else forward + backward + reference
    for step in choice.steps.values():
        assert step >= blocks * micro * work / world - 1e-9
    policy, ref = choice.ranks
    assert len(policy) == len(ref) and (policy == ref) == (choice.where == "shared")


@settings(max_examples=20, deadline=None)
@given(forward=st.floats(0.1, 2.0), backward=st.floats(0.1, 4.0), tower=st.floats(0.1, 8.0), trains=st.booleans(),
       transfer=st.floats(0.0, 3.0), world=st.integers(1, 4), blocks=st.integers(4, 9), micro=st.integers(1, 8),
       zero_bubble=st.booleans())
def test_the_tower_goes_where_the_replayed_plan_is_shorter(forward, backward, tower, trains, transfer, world, blocks,
                                                          micro, zero_bubble):
    """`hp.mpmd.choice.choose_tower`: the language model over every rank with the tower in its bubbles, or
    over fewer with the tower on the rest, whichever's plan replays shorter; with `zero_bubble` each way is
    planned with the language model's backward split."""
    from hp.mpmd.choice import TowerCosts, choose_tower

    costs = TowerCosts(forward, backward, tower, 2 * tower if trains else 0.0, transfer, transfer / 4)
    choice = choose_tower(costs, world=world, blocks=blocks, microbatches=micro, trains=trains, zero_bubble=zero_bubble)
    assert set(choice.steps) == {"shared", *(f"own {n}" for n in range(1, world))}
    assert choice.steps[choice.where] == min(choice.steps.values())
    work = micro * (blocks * (forward + backward) + tower * (3 if trains else 1))
    assert all(step >= work / world - 1e-9 for step in choice.steps.values())
    stages, towers = choice.ranks
    assert (towers == stages) == (choice.where == "shared") and len(stages) + (choice.where != "shared") * len(towers) == world


def test_block_costs_are_measured_on_the_whole_model_without_touching_its_state():
    import torch
    from hp.models import plan_for, tiny_config
    from transformers import AutoModelForCausalLM

    from hp.mpmd.choice import block_costs

    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2)).train()
    before = torch.random.get_rng_state()
    costs = block_costs(model, plan_for(model.config), tokens=16, rounds=2)
    assert costs.forward > 0 and costs.backward > 0 and costs.reference > 0 and costs.transfer == 0.0  # one process
    assert model.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), before)


def test_tower_costs_are_measured_on_a_sample_with_images_without_touching_the_model():
    import torch
    from hp.models import plan_for, tiny_config, tiny_vl_batch
    from transformers import AutoModelForImageTextToText

    from hp.mpmd.choice import tower_costs

    model = AutoModelForImageTextToText.from_config(tiny_config("qwen2_5_vl", layers=2)).train()
    batch = {k: v for k, v in tiny_vl_batch(model, seq=32, seed=0).items() if k != "position_ids"}
    before = torch.random.get_rng_state()
    trained = tower_costs(model, plan_for(model.config), batch, rounds=2)
    model.get_submodule(plan_for(model.config).vision).requires_grad_(False)
    frozen = tower_costs(model, plan_for(model.config), batch, rounds=2)
    assert trained.tower_forward > 0 and trained.tower_backward > 0 and frozen.tower_backward == 0.0
    assert model.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), before)

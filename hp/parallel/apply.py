"""`hp.apply_strategy`: one strategy, applied the same way to any model plan.

This is where a `hp.Strategy` meets a `hp.ModelPlan`: the mesh of the
strategy's axes, the plan's tensor-parallel layouts (only when tp > 1), the
residual stream's layout at every module the plan says adds to it (so a
row-parallel projection's pending sum is reduced there, once: an all-reduce,
or a reduce-scatter under sequence parallel, whatever norm follows it), the
batch and sequence splits of the inputs, context-parallel attention, the
sequence preparation of `hp.parallel.sequence`, FSDP or the dp/cp gradient
reduction of `hp.parallel.data_parallel`, expert parallel for the plan's experts
modules (`hp.ops.expert_parallel`) with the routing bias of
`hp.parallel.expert_balance`, activation recompute of the plan's
blocks (`hp.parallel.recompute`), and `torch.compile` of each block and of the
loss (`hp.compile_blocks`, `hp.compile_loss`). A vision-language plan's
vision tower runs whole on every rank (`hp.run_replicated`) and is an FSDP unit of its own; its
decoder's input is cut to each rank's batch and sequence block with a
pending gradient (`hp.constrain(pending_grad=True)`), so the tower's
gradients pend over dp, ep and cp like every other's. Nothing here knows
a model family.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from hp.parallel.compiled import compile_blocks, compile_loss
from hp.parallel.data_parallel import fully_shard_model, fully_shard_plain
from hp.parallel.expert_balance import biased_routing
from hp.layouts import constrain
from hp.parallel.lora import adapter_layouts
from hp.parallel.hf_attention import (own_mask_attention, paired_heads_attention, ring_around_attention, takes_ring,
                                      ulysses_around_attention, uses_sdpa)
from hp.mesh import mesh as make_mesh
from hp.parallel.model_plan import ModelPlan, held_blocks
from hp.ops.context_parallel import context_parallel
from hp.ops.expert_parallel import count_outside_graphs, expert_parallel, routes_tokens
from hp.parallel.parallelize import check_plan, forward_inside, parallelize
from hp.parallel.plain_dp import plain_data_parallel, takes_plain_dp
from hp.parallel.recompute import recompute_blocks
from hp.parallel.replicated import run_replicated
from hp.parallel.rowwise import run_rowwise
from hp.parallel.sequence import prepare_sequences
from hp.parallel.strategy import Strategy, StrategyError
from hp.parallel.vision_batch import split_images


def strategy_mesh(strategy: Strategy | Mapping[str, Any], *, simulate: bool = False):
    """The named mesh a strategy runs on: its dp, ep, cp and tp axes of size > 1.

    >>> import hp
    >>> hp.strategy_mesh({"dp": 2, "tp": 2}, simulate=True).mesh_dim_names
    ('dp', 'tp')
    """
    return make_mesh(**Strategy.of(strategy).mesh_axes, simulate=simulate)


def token_layout(strategy: Strategy) -> str:
    """The layout of a batch of tokens: the batch split over dp and ep, the sequence over cp.

    >>> token_layout(Strategy(dp=4, ep=2, cp=2))
    'b/dp/ep s/cp'
    """
    return " ".join(("/".join(("b", *strategy.batch_axes)), "s/cp" if strategy.cp > 1 else "s"))


def stream_layout(strategy: Strategy) -> str:
    """The residual stream's layout: the tokens', features whole (tokens over tp too under sequence parallel;
    2D tensor parallel's own under tp2d).

    >>> stream_layout(Strategy(dp=2, tp=2, sp=True)), stream_layout(Strategy(cp=2, tp2d={"x": 2, "y": 2}))
    ('b/dp s/tp h', 'b/y s/cp h/x')
    """
    tokens = token_layout(strategy)
    if strategy.tp2d is not None:
        return strategy.tp2d.stream(*tokens.split())
    return f"{tokens}/tp h" if strategy.sequence_parallel else f"{tokens} h"


def layouts(strategy: Strategy, plan: ModelPlan) -> tuple[dict[str, str], dict, dict]:
    """(parameter layouts, input layouts, output layouts) that `hp.parallelize` applies.

    The same with or without FSDP: FSDP shards the laid-out parameters again afterwards.

    >>> from hp.models import plan_for_type
    >>> params, inputs, outputs = layouts(Strategy(tp=2, sp=True), plan_for_type("llama"))
    >>> outputs["model.embed_tokens"], outputs["*.self_attn.o_proj"]
    ('b s/tp h', 'b s/tp h')
    >>> layouts(Strategy(dp=2, ep=2), plan_for_type("qwen3_moe"))[1][""]["input_ids"]
    'b/ep s'
    """
    tokens = token_layout(strategy)
    split = tokens != "b s"
    residual = stream_layout(strategy)
    labels = {"labels": tokens, "shift_labels": tokens}
    experts = dict(plan.expert_params) if strategy.ep > 1 else {}
    if plan.decoder is None:
        inputs = {"": {"input_ids": tokens, **labels}} if split else {}
        # The embedding starts the residual stream: a vocab-parallel (tied) one hands back a pending sum.
        starts = {plan.embedding: residual}
    else:  # the text reaches the decoder embedded, images in it: the stream starts, and splits, at its input
        inputs = {"": labels} if split else {}
        if split or strategy.tp > 1:
            inputs[plan.decoder] = {"inputs_embeds": residual}
        starts = {}
    if strategy.tp == 1 and strategy.tp2d is None:
        return experts, inputs, {}
    outputs = {name: residual for name in (*starts, *plan.residual)}
    if strategy.tp2d is not None:  # each Megatron layout over x and y (hp.parallel.tp2d)
        return {k: strategy.tp2d.param_layout(v) for k, v in plan.params.items()}, inputs, outputs
    params = {**experts, **plan.params}
    if strategy.vision_tp:  # the tower's stream is its patches, whole on every rank: "p h"
        outputs.update({name: "p h" for name in plan.vision_residual})
        params.update(plan.vision_params)
    return params, inputs, outputs


def apply_strategy(model: nn.Module, mesh, strategy: Strategy | Mapping[str, Any], plan: ModelPlan) -> nn.Module:
    """`model` laid out in place by `strategy` on `mesh` (from `strategy_mesh`), as `plan` describes it.

    To simulate ranks with real values, apply inside `hp.simulated(mesh)`, so each simulated
    rank keeps its own blocks. With `recompute`, each of the plan's blocks recomputes its
    activations in backward (`hp.parallel.recompute`); parameter names stay the model's.

    >>> import hp
    >>> from hp.models import plan_for, tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> config = tiny_config("llama", layers=1)
    >>> mesh = hp.strategy_mesh({"tp": 2, "sp": True}, simulate=True)
    >>> with hp.simulated(mesh):
    ...     model = hp.apply_strategy(AutoModelForCausalLM.from_config(config), mesh, {"tp": 2, "sp": True},
    ...                               plan_for(config))
    ...     print(hp.describe(model.model.layers[0].self_attn.o_proj.weight))
    f32[out=64, in=64/tp]
    """
    strategy = Strategy.of(strategy)
    _check_unsplit(model, strategy, plan)
    _check_heads(model, strategy)
    _check_tp2d(model, strategy, plan)
    if takes_plain_dp(model, mesh, strategy) and plan.vision is None:
        return _plain_dp(model, mesh, strategy, plan)
    params, inputs, outputs = layouts(strategy, plan)
    params = _present({**params, **adapter_layouts(params)}, model.named_parameters(remove_duplicate=False))
    outputs = _present(outputs, model.named_modules())
    parallelize(model, mesh, params, inputs=inputs, outputs=outputs)
    run_rowwise(model, plan)
    if plan.vision is not None:  # whole on every rank; its gradients pend where the decoder's input splits
        run_replicated(model.get_submodule(plan.vision), mesh, pending=strategy.token_axes)
        if strategy.batch_axes:  # each rank encodes its own samples' images
            split_images(model.get_submodule(plan.vision.rpartition(".")[0]), mesh, strategy.batch_axes)
    if plan.decoder is not None and strategy.token_axes:
        _cut_decoder_input(model.get_submodule(plan.decoder), token_layout(strategy))
    experts = expert_parallel(model, plan.experts)
    if strategy.expert_bias_rate:
        biased_routing(model, plan.routers)
    if strategy.fsdp_axes:
        units = [*held_blocks(model, plan), *([model.get_submodule(plan.vision)] if plan.vision else [])]
        fully_shard_model(model, mesh, units, strategy, experts=experts)
    if strategy.cp > 1:
        # A vision tower attends within each image, on every rank in full: only the decoder's attention splits.
        _context_parallel_attention(model.get_submodule(plan.decoder) if plan.decoder else model, strategy)
    if strategy.splits_sequence:
        prepare_sequences(model, strategy, plan)
    return _blocks_as_asked(model, strategy, plan)


def _plain_dp(model: nn.Module, mesh, strategy: Strategy, plan: ModelPlan) -> nn.Module:
    """Only the batch splits: plain parameters, each rank its rows (`hp.parallel.plain_dp`), FSDP2 over dp
    around them when asked."""
    if strategy.fsdp:
        fully_shard_plain(model, mesh, held_blocks(model, plan), strategy)
    plain_data_parallel(model, mesh, sums=not strategy.fsdp)
    expert_parallel(model, plan.experts)  # plain experts run as they are; their loads are still counted
    if strategy.expert_bias_rate:
        biased_routing(model, plan.routers)
    return _blocks_as_asked(model, strategy, plan)


def _blocks_as_asked(model: nn.Module, strategy: Strategy, plan: ModelPlan) -> nn.Module:
    """The plan's blocks compiled and / or recomputing, as `strategy` asks. Compiled, a block recomputes
    inside its graph, or around routed experts it compiles around (`hp.compile_blocks`); eager, under
    checkpoint (`hp.parallel.recompute`)."""
    blocks = held_blocks(model, plan)
    if strategy.compile:
        compile_blocks(blocks, recompute=strategy.recompute, eager=_stays_eager(model, plan))
        compile_loss(model)
        count_outside_graphs(blocks)
    elif strategy.recompute:
        recompute_blocks(blocks)
    return model


def _stays_eager(model: nn.Module, plan: ModelPlan):
    """What no compiled graph may hold, if anything: experts laid out as DTensors (their exchanges are
    sized while the step runs) and, beside them, the routers, whose logits the block drops (kept for an
    auxiliary loss): a graph of a router's own would be handed no gradient for them."""
    if not any(routes_tokens(m) for m in model.modules()):
        return None
    routers = {id(m) for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in plan.routers)}
    return lambda module: routes_tokens(module) or id(module) in routers


def check_strategy(model: nn.Module, strategy: Strategy | Mapping[str, Any], plan: ModelPlan) -> None:
    """What `apply_strategy` would refuse, found without a mesh or data (a meta-device model will do).

    >>> import torch, hp
    >>> from transformers import AutoModelForCausalLM
    >>> from hp.models import plan_for, tiny_config
    >>> with torch.device("meta"):
    ...     model = AutoModelForCausalLM.from_config(tiny_config("gemma2", layers=1))
    >>> hp.check_strategy(model, {"cp": 2, "cp_algorithm": "ring"}, plan_for(model.config))
    Traceback (most recent call last):
    ...
    hp.parallel.strategy.StrategyError: cp_algorithm = 'ring' cannot soft-cap attention logits (attn_logit_softcapping = 50.0): ring attention merges blocks of SDPA; use ulysses
    """
    strategy = Strategy.of(strategy)
    _check_unsplit(model, strategy, plan)
    _check_heads(model, strategy)
    _check_tp2d(model, strategy, plan)
    strategy.check_fits(model.config)
    params, _, _ = layouts(strategy, plan)
    params = {**params, **adapter_layouts(params)}
    check_plan(model, strategy.mesh_axes, _present(params, model.named_parameters(remove_duplicate=False)))
    _check_attention(model, strategy)
    if strategy.vision_tp and plan.vision is None:
        raise StrategyError("vision_tp", True, f": the plan of {type(model).__name__} has no vision tower to split; "
                            "leave it out")
    if strategy.expert_bias_rate and not any(fnmatch.fnmatchcase(n, g) for n, _ in model.named_modules()
                                             for g in plan.routers):
        raise StrategyError("expert_bias_rate", strategy.expert_bias_rate, f": the plan of {type(model).__name__} "
                            "names no softmax top-k routers to bias; set it to 0")


def _cut_decoder_input(decoder: nn.Module, tokens: str) -> None:
    """A vision-language decoder's input, computed whole on every rank, cut to the rank's batch and
    sequence block before it takes the residual stream's layout. Its gradient comes back pending
    over those axes, not gathered, so the vision tower's gradients pend like every other's."""

    def cut_input(mod, args, kwargs):
        kwargs["inputs_embeds"] = constrain(kwargs["inputs_embeds"], f"{tokens} h", pending_grad=True)
        return args, kwargs

    decoder.register_forward_pre_hook(cut_input, with_kwargs=True, prepend=True)


def _check_unsplit(model: nn.Module, strategy: Strategy, plan: ModelPlan) -> None:
    for key in ("tp", "cp", "ep"):
        if plan.unsplit is not None and getattr(strategy, key) > 1:
            raise StrategyError(key, getattr(strategy, key), f": {type(model).__name__} has {plan.unsplit} layers, "
                                f"which hp cannot split over {key} yet; dp and FSDP run any family")


def _check_heads(model: nn.Module, strategy: Strategy) -> None:
    paired = paired_heads_attention(model) if strategy.tp > 1 else None
    if paired is not None:
        raise StrategyError("tp", strategy.tp, f": {paired} is differential attention, which pairs head h with head "
                            "h + heads/2 and the halves of its values across the heads that tp splits in order, so "
                            "every layer would gather its heads over tp; dp, FSDP and cp (ulysses or ring) run it")


def _check_tp2d(model: nn.Module, strategy: Strategy, plan: ModelPlan) -> None:
    if strategy.tp2d is None:
        return
    if strategy.tp2d.scheme == "auto":
        raise StrategyError("tp2d.scheme", "auto", ": decide it for the model first, with "
                            "strategy.resolved(model.config, tokens) (hp train does)")
    if plan.experts or plan.vision is not None or plan.unsplit is not None:
        kind = "experts" if plan.experts else "a vision tower" if plan.vision else f"{plan.unsplit} layers"
        raise StrategyError("tp2d", strategy.tp2d, f": {type(model).__name__} has {kind}; 2D tensor parallel runs "
                            "the dense decoder families; use tp")
    _check_heads(model, dataclasses.replace(strategy, tp2d=None, tp=strategy.tp2d.ranks))


def _check_attention(model: nn.Module, strategy: Strategy) -> None:
    if strategy.ring and not uses_sdpa(model) and not takes_ring(model):
        raise StrategyError("cp_algorithm", "ring", f": ring attention needs SDPA attention (or eager attention "
                            f"with learned sinks), and this {type(model).__name__} runs "
                            f"'{model.config._attn_implementation}' attention; use cp_algorithm ulysses")
    masked = own_mask_attention(model) if strategy.ring else None
    if masked is not None:
        raise StrategyError("cp_algorithm", "ring", f": {masked} attends under a mask {type(model).__name__} "
                            "always builds, in the tokens' order, and adds its own terms to; ring attention runs "
                            "causal SDPA without masks on tokens in head-tail order; use cp_algorithm ulysses "
                            "(tp and dp run too)")


def _context_parallel_attention(model: nn.Module, strategy: Strategy) -> None:
    """SDPA runs on hp's ring or Ulysses kernels; any other attention, Ulysses around it, or under ring,
    an eager attention with sinks on the ring kernel."""
    _check_attention(model, strategy)
    if not uses_sdpa(model):
        (ring_around_attention if strategy.ring else ulysses_around_attention)(model)
    order = "head_tail" if strategy.ring else "contiguous"
    forward_inside(model, lambda: context_parallel(strategy.cp_algorithm, order=order))


def _present(entries: dict[str, str], names) -> dict[str, str]:
    """The plan entries whose glob matches one of `names` (a family's optional biases, say)."""
    names = [n for n, _ in names]
    return {k: v for k, v in entries.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}

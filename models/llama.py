"""The reference plan for HF Llama-family models (Llama, Qwen2, Qwen3 dense), as layouts.

One declarative strategy, `{"dp": 2, "tp": 2, "sp": True}`, becomes a named mesh
and a parallelized `LlamaForCausalLM` (or `Qwen2ForCausalLM`, `Qwen3ForCausalLM`:
same module names). Tensor parallel is Megatron's: q, k, v, gate, up split by
output features, o and down by input features, the LM head by vocabulary (so
the loss runs vocab-parallel). With `sp`, the residual stream, norms and
dropout run on tokens split over tp (sequence parallel): the block inputs are
all-gathered and the block outputs reduce-scattered instead of all-reduced.
`cp` splits the sequence: attention runs context-parallel (`cp_algorithm`,
Ulysses by default), RoPE takes each rank's positions from the replicated
cos/sin. `dp` splits the batch. Parameter gradients are pending sums over
dp and cp (`+dp +cp`), reduced where the optimizer step reduces them (FSDP
lands with issue 5).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

import hp
from hp import tp_plan
from hp.parallelize import forward_inside

# Layouts of nn.Linear weights, which are stored (out, in).
TP_PLAN = {
    "*.self_attn.[qkv]_proj.weight": "out/tp in",
    "*.mlp.gate_proj.weight": "out/tp in",
    "*.mlp.up_proj.weight": "out/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}
BIAS_PLAN = {"*.self_attn.[qkv]_proj.bias": "out/tp"}  # Qwen2 has q/k/v biases


@dataclass(frozen=True)
class Strategy:
    """How to parallelize: data-parallel and tensor-parallel degrees, sequence parallel."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False
    cp_algorithm: str = "ulysses"

    @classmethod
    def parse(cls, spec: Strategy | Mapping) -> Strategy:
        if isinstance(spec, Strategy):
            return spec
        known = ("dp", "cp", "tp", "sp", "cp_algorithm")
        unknown = set(spec) - set(known)
        if unknown:
            raise ValueError(f"strategy keys {sorted(unknown)} are not supported (known: {', '.join(known)})")
        return cls(**spec)


def layouts(strategy: Strategy) -> tuple[dict[str, str], dict, dict]:
    """(parameter plan, input layouts, output layouts) for `hp.parallelize`.

    Only axes of size > 1 exist on the strategy's mesh (DTensor's redistribution
    planner slows down sharply with idle axes), so layouts name only those.
    """
    batch = "b/dp" if strategy.dp > 1 else "b"
    seq = "s/cp" if strategy.cp > 1 else "s"
    split = strategy.dp > 1 or strategy.cp > 1
    inputs = {"": {"input_ids": f"{batch} {seq}", "labels": f"{batch} {seq}"}} if split else {}
    residual = f"{batch} {seq}/tp h" if strategy.sp and strategy.tp > 1 else None
    outputs = {"model.embed_tokens": residual} if residual else {}
    return ({**TP_PLAN, **BIAS_PLAN} if strategy.tp > 1 else {}), inputs, outputs


def strategy_mesh(strategy: Strategy | Mapping, *, simulate: bool = False):
    """The dp x tp mesh a strategy runs on."""
    strategy = Strategy.parse(strategy)
    degrees = {"dp": strategy.dp, "cp": strategy.cp, "tp": strategy.tp}
    axes = {name: n for name, n in degrees.items() if n > 1} or {"tp": 1}
    return hp.mesh(**axes, simulate=simulate)


def parallelize_llama(model: nn.Module, mesh, strategy: Strategy | Mapping) -> nn.Module:
    """`model` laid out in place by `strategy` on `mesh` (from `strategy_mesh`).

    To simulate ranks with real values, shard inside `hp.simulated(mesh)`, so each simulated
    rank keeps its own blocks.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    >>> mesh = strategy_mesh({"tp": 2, "sp": True}, simulate=True)
    >>> with hp.simulated(mesh):
    ...     model = parallelize_llama(LlamaForCausalLM(config), mesh, {"tp": 2, "sp": True})
    ...     print(hp.describe(model.model.layers[0].self_attn.o_proj.weight))
    f32[out=32, in=32/tp]
    """
    strategy = Strategy.parse(strategy)
    plan, inputs, outputs = layouts(strategy)
    hp.parallelize(model, mesh, _present(plan, model), inputs=inputs, outputs=outputs)
    if strategy.cp > 1:
        forward_inside(model, lambda: hp.context_parallel(strategy.cp_algorithm))
    return model


def reduce_gradients(model: nn.Module) -> None:
    """Resolve the pending sums of parameter gradients (over dp and cp) into the parameters' layouts.

    The data-parallel gradient reduction, done where the step wants it (before the optimizer).
    """
    from torch.distributed.tensor import DTensor, Partial

    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)


def choice_layouts(choice: tp_plan.Choice) -> tuple[dict[str, str], dict[str, str]]:
    """(parameter plan, module output layouts) realising a `hp.tp_plan.choose` result."""
    if choice.scheme == "1d":
        return dict(TP_PLAN), {}
    if choice.scheme == "summa":  # every weight alike: out over y, in over x
        return {
            "*.self_attn.[qkvo]_proj.weight": "out/y in/x", "*.mlp.*_proj.weight": "out/y in/x",
            "lm_head.weight": "vocab/y h/x",
        }, {"model.embed_tokens": "b/x s h/y"}
    tokens = "b/z/y" if choice.scheme == "3d" else "b/y"  # 2D: linears alternate orientation
    return {
        "*.self_attn.[qkv]_proj.weight": "out/y in/x", "*.mlp.gate_proj.weight": "out/y in/x",
        "*.mlp.up_proj.weight": "out/y in/x", "*.self_attn.o_proj.weight": "out/x in/y",
        "*.mlp.down_proj.weight": "out/x in/y", "lm_head.weight": "vocab/y h/x",
    }, {"model.embed_tokens": f"{tokens} s h/x"}


def _present(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The plan entries that match some parameter (the bias entries only on models with biases)."""
    names = [n for n, _ in model.named_parameters()]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}

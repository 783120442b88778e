"""The reference plan for HF Llama-family models (Llama, Qwen2, Qwen3 dense), as layouts.

One declarative strategy, `{"dp": 2, "tp": 2, "sp": True}`, becomes a named mesh
and a parallelized `LlamaForCausalLM` (or `Qwen2ForCausalLM`, `Qwen3ForCausalLM`:
same module names). Tensor parallel is Megatron's: q, k, v, gate, up split by
output features, o and down by input features, the LM head by vocabulary (so
the loss runs vocab-parallel). With `sp`, the residual stream, norms and
dropout run on tokens split over tp (sequence parallel): the block inputs are
all-gathered and the block outputs reduce-scattered instead of all-reduced.
`dp` splits the batch; parameter gradients are then pending sums over dp
(`+dp`), reduced where the optimizer step reduces them (context parallel and
FSDP land with issue 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

import hp

TP_PLAN = {
    "*.self_attn.[qkv]_proj.weight": "out/tp in",
    "*.self_attn.[qkv]_proj.bias": "out/tp",  # Qwen2 has q/k/v biases
    "*.mlp.gate_proj.weight": "out/tp in",
    "*.mlp.up_proj.weight": "out/tp in",
    "*.self_attn.o_proj.weight": "out in/tp",
    "*.mlp.down_proj.weight": "out in/tp",
    "lm_head.weight": "vocab/tp h",
}


@dataclass(frozen=True)
class Strategy:
    """How to parallelize: data-parallel and tensor-parallel degrees, sequence parallel."""

    dp: int = 1
    tp: int = 1
    sp: bool = False

    @classmethod
    def parse(cls, spec: Strategy | Mapping) -> Strategy:
        if isinstance(spec, Strategy):
            return spec
        unknown = set(spec) - {"dp", "tp", "sp"}
        if unknown:
            raise ValueError(f"strategy keys {sorted(unknown)} are not supported (known: dp, tp, sp)")
        return cls(**spec)


def layouts(strategy: Strategy) -> tuple[dict[str, str], dict, dict]:
    """(parameter plan, input layouts, output layouts) for `hp.parallelize`."""
    batch = "b/dp" if strategy.dp > 1 else "b"
    inputs = {"": {"input_ids": f"{batch} s", "labels": f"{batch} s"}} if strategy.dp > 1 else {}
    outputs = {"model.embed_tokens": f"{batch} s/tp h"} if strategy.sp else {}
    return dict(TP_PLAN), inputs, outputs


def strategy_mesh(strategy: Strategy | Mapping, *, simulate: bool = False):
    """The dp x tp mesh a strategy runs on."""
    strategy = Strategy.parse(strategy)
    return hp.mesh(dp=strategy.dp, tp=strategy.tp, simulate=simulate)


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
    used = {k: v for k, v in plan.items() if any(_matches(n, k) for n, _ in model.named_parameters())}
    return hp.parallelize(model, mesh, used, inputs=inputs, outputs=outputs)


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)

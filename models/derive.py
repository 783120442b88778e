"""A family's `hp.ModelPlan`, derived from the plans transformers ships with the model.

transformers describes how to split most of its models: a tensor-parallel
plan (module or parameter glob -> style), an expert-parallel plan and a
pipeline plan (the embedding, the decoder blocks, the final norm, the head),
merged by the model at construction (a model with a tp plan and no pp plan
gets transformers' usual names: `{base model}.layers` and its input embeddings). `derive(config)` builds the model on the
meta device, reads the three plans and translates them:

=============================  ==========================================
HF style                       hp
=============================  ==========================================
colwise                        weight `out/tp in`, bias `out/tp`
colwise_gather_output          the same, kept split (see below)
rowwise, rowwise_split_input   weight `out in/tp`; the output joins the
                               residual stream, where its sum resolves
packed_colwise                 weight `[gate up]/tp in`
grouped_gemm (expert plan)     `e/ep ...`: the experts split over ep
ep_dispatch_experts            the experts module runs hp's dispatch
embedding_rowwise, replicate,  nothing: whole on every rank
replicated_with_grad_allreduce
moe_tp_experts, 3-D colwise    nothing: experts stay whole over tp
=============================  ==========================================

HF's plans are written for inference, and the derivation does better where
training wants Megatron's layout:

- the head stays split by vocabulary (`vocab/tp h`) and the loss runs
  vocab-parallel, where HF gathers the logits;
- q, k, v projections that HF gathers (OLMo-2's full-width q/k norms) stay
  split; hp's rules resolve the norm's sum of squares across ranks;
- fused projections that HF gathers split by their parts: `gate_up_proj` as
  `[gate up]/tp`, `qkv_proj` as `[q k v]/tp` when the parts are equal (else
  whole);
- attention and MLP projections that HF leaves whole (gpt-oss's attention,
  Qwen2-MoE's shared expert) split by their names: `q_proj`, `k_proj`,
  `v_proj`, `gate_proj`, `up_proj` by output, `o_proj`, `down_proj` by input,
  an attention's `sinks` with its heads;
- a mixture-of-experts block (the parent of an experts module) joins the
  residual stream as a whole, so its shared expert's pending sum resolves
  once with the routed experts' output.

The token embedding is left whole unless it is tied to the head (then it is
the head's vocab-parallel parameter): splitting it by vocabulary would add an
all-reduce of the residual stream to every step to save a small share of
memory.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from hp.models.unsplit import unsplit_layer
from hp.parallel.model_plan import ModelPlan

COLWISE = {"colwise", "colwise_rep", "colwise_gather_output"}
ROWWISE = {"rowwise", "rowwise_split_input", "rowwise_rep"}
# Projections split by name where HF's plan leaves them whole (None: none of these).
BY_NAME = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
           "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise", "gate_up_proj": "packed_colwise"}


def hf_plan(model: Any, kind: str) -> dict[str, str]:
    """The model's merged `kind` ("tp", "ep" or "pp") plan: `model.tp_plan` in transformers >= 5.2x, `_tp_plan` before.

    >>> from hp.models import tiny_config
    >>> hf_plan(meta_model(tiny_config("llama")), "tp")["model.layers.*.self_attn.q_proj"]
    'colwise'
    """
    return getattr(model, f"{kind}_plan", None) or getattr(model, f"_{kind}_plan", None) or {}


def derive(config: Any) -> ModelPlan:
    """The plan of an HF causal LM's config, from the model's own tp, ep and pp plans (module docstring).

    >>> from hp.models import tiny_config
    >>> plan = derive(tiny_config("llama"))
    >>> plan.params["*.self_attn.q_proj.weight"], plan.params["lm_head.weight"], plan.residual
    ('out/tp in', 'vocab/tp h', ('*.self_attn.o_proj', '*.mlp.down_proj'))
    """
    model = meta_model(config)
    blocks, embedding, norm, head = _pipeline_stages(model)
    head = _head_name(model)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    styles = _styles(model, modules, parameters)
    experts = _experts(hf_plan(model, 'ep'), modules)
    moe_blocks = {name.rpartition(".")[0] for name in experts}
    params: dict[str, str] = {}
    residual: list[str] = []
    for name, style in styles.items():
        if any(name.startswith(e + ".") for e in experts):
            continue  # an expert's weights split over ep (below); over tp they stay whole
        module = modules.get(name)
        if module is not None and name == head:
            params[f"{name}.weight"] = "vocab/tp h"
            if getattr(module, "bias", None) is not None:  # CodeGen's, Phi's: split with the vocabulary
                params[f"{name}.bias"] = "vocab/tp"
            continue
        for param, layout in _layouts(name, module, style, parameters, config).items():
            params[param] = layout
        if style in ROWWISE and module is not None:
            block = next((b for b in moe_blocks if name.startswith(b + ".")), None)
            residual.append(block if block is not None else name)
    residual += sorted(moe_blocks)  # the experts' sum joins the stream (after a shared expert's, if any)
    expert_params = {name: _expert_layout(parameters[name]) for name in _expert_params(hf_plan(model, 'ep'), parameters)}
    return ModelPlan(
        params={_glob(k, blocks): v for k, v in params.items()},
        residual=tuple(dict.fromkeys(_glob(r, blocks) for r in residual)),
        blocks=blocks,
        embedding=embedding,
        norm=norm,
        head=head,
        rotary=_rotary(modules, blocks),
        experts=tuple(dict.fromkeys(_glob(e, blocks) for e in experts)),
        expert_params={_glob(k, blocks): v for k, v in expert_params.items()},
        routers=tuple(dict.fromkeys(_glob(r, blocks) for r in _routers(experts, modules))),
        rowwise=_norms(modules, blocks),
        unsplit=unsplit_layer(model),
    )


def meta_model(config: Any):
    """The causal LM of `config` built on the meta device: its modules and merged plans, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _pipeline_stages(model) -> tuple[str, str, str | None, str | None]:
    """(decoder blocks, token embedding, final norm, head) from the pp plan: the ModuleList, what takes
    `input_ids`, what follows the blocks, and what makes the logits.

    A model whose pp plan names neither blocks nor embedding (OLMoE, PhiMoE, ...: only its head) has
    them where transformers' decoders keep them: `{base model}.layers` and the module
    `get_input_embeddings` returns; the norm and head are found the same way.
    """
    from torch import nn

    plan = hf_plan(model, 'pp')
    blocks = next((k for k in plan if isinstance(model.get_submodule(k), nn.ModuleList)), None)
    embedding = next((k for k, (inputs, _) in plan.items() if "input_ids" in inputs), None)
    if blocks is None and embedding is None:
        prefix = f"{model.base_model_prefix}." if model.base_model is not model else ""
        blocks = f"{prefix}layers" if isinstance(getattr(model.base_model, "layers", None), nn.ModuleList) else None
        embedding = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), None)
    if blocks is None or embedding is None:
        raise ValueError(f"{type(model).__name__} has no pipeline plan naming its decoder blocks and embedding, "
                         "and no `layers` list beside its input embeddings")
    names = list(plan)
    after = names[names.index(blocks) + 1:] if blocks in names else []
    norm = next((k for k in after if "logits" not in plan[k][1]), None)
    if norm is None and blocks.rpartition(".")[0] + ".norm" in dict(model.named_modules()):
        norm = blocks.rpartition(".")[0] + ".norm"
    head = next((k for k, (_, outputs) in plan.items() if "logits" in outputs), None)
    if head is None:
        head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    return blocks, embedding, norm, head


def _styles(model, modules: dict, parameters: dict) -> dict[str, str]:
    """Each module or parameter's style: HF's tp plan resolved on the model's names, then the names HF leaves."""
    styles: dict[str, str] = {}
    for pattern, style in hf_plan(model, 'tp').items():
        for name in (*modules, *parameters):
            if fnmatch.fnmatchcase(name, pattern):
                styles.setdefault(name, style)
    for name, module in modules.items():
        leaf = name.rpartition(".")[2]
        if leaf in BY_NAME and name not in styles and _is_linear(module):
            styles[name] = BY_NAME[leaf]
    for name, param in parameters.items():  # an attention's sinks, one per head, split with the heads
        owner, _, leaf = name.rpartition(".")
        if leaf == "sinks" and param.ndim == 1 and styles.get(f"{owner}.q_proj") in COLWISE:
            styles[name] = "colwise"
    return styles


def _layouts(name: str, module, style: str, parameters: dict, config: Any) -> dict[str, str]:
    """Parameter layouts for one entry of the plan (a module's weight and bias, or a parameter)."""
    if module is None:  # a parameter named by the plan itself
        param = parameters[name]
        return {name: "out/tp"} if style in COLWISE and param.ndim == 1 else {}
    if not _is_linear(module):
        return {}
    weight = module.weight
    if weight.ndim != 2:
        return {}
    leaf = name.rpartition(".")[2]
    if style in ROWWISE:
        return {f"{name}.weight": "out in/tp"}
    if style == "packed_colwise" or (style == "colwise_gather_output" and "gate_up" in leaf):
        return _with_bias(name, "[gate up]/tp", module)
    if style == "colwise_gather_output" and "qkv" in leaf:
        return _with_bias(name, "[q k v]/tp", module) if _equal_qkv(weight.shape[0], config) else {}
    if style == "colwise_gather_output" and not leaf.endswith(("q_proj", "k_proj", "v_proj")):
        return {}  # an output HF gathers for a reason the derivation cannot see: left whole
    if style in COLWISE:
        return _with_bias(name, "out/tp", module)
    return {}


def _with_bias(name: str, out: str, module) -> dict[str, str]:
    layouts = {f"{name}.weight": f"{out} in"}
    if getattr(module, "bias", None) is not None:
        layouts[f"{name}.bias"] = out
    return layouts


def _equal_qkv(out_features: int, config: Any) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads is not None and heads == kv and out_features % 3 == 0


def _is_linear(module) -> bool:
    from torch import nn

    return isinstance(module, nn.Linear)


def _head_name(model) -> str | None:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _experts(ep_plan: dict, modules: dict) -> list[str]:
    return [name for pattern, style in ep_plan.items() if style == "ep_dispatch_experts"
            for name in modules if fnmatch.fnmatchcase(name, pattern)]


def _expert_params(ep_plan: dict, parameters: dict) -> list[str]:
    return [name for pattern, style in ep_plan.items() if style == "grouped_gemm"
            for name in parameters if fnmatch.fnmatchcase(name, pattern)]


def _expert_layout(param) -> str:
    """Packed experts' weights split along their first dim (one expert per row) over ep."""
    return " ".join(("e/ep", *("out", "in")[: param.ndim - 1]))


def _routers(experts: list[str], modules: dict) -> list[str]:
    """The module beside each experts module that scores the experts (`gate` or `router`)."""
    found = []
    for name in experts:
        block = name.rpartition(".")[0]
        found += [f"{block}.{leaf}" for leaf in ("gate", "router") if f"{block}.{leaf}" in modules]
    return found


def _rotary(modules: dict, blocks: str) -> str | None:
    """The module that returns RoPE's (cos, sin) beside the blocks, if the family has one; a glob where
    there are several (Granite-SWA's `rotary_embs`, one per RoPE theta)."""
    base = blocks.rpartition(".")[0]
    name = f"{base}.rotary_emb" if base else "rotary_emb"
    several = [n for n, m in modules.items() if n.startswith(f"{name}s.") and type(m).__name__.endswith("Embedding")]
    return f"{name}*" if several else name if name in modules else None


def _norms(modules: dict, blocks: str) -> tuple[str, ...]:
    """Globs of the norm modules (a class named ...Norm): each mixes values along its input's last dim only."""
    leaves = sorted({name.rpartition(".")[2] for name, m in modules.items() if type(m).__name__.endswith("Norm")})
    if all(leaf.endswith("norm") for leaf in leaves):
        return ("*norm",)
    return tuple(f"*{leaf}" if leaf.endswith("norm") else f"*.{leaf}" for leaf in leaves)


def _glob(name: str, blocks: str) -> str:
    """`model.layers.*.mlp.down_proj` (or `.3.`) as `*.mlp.down_proj`: the same name in every block."""
    prefix = blocks + "."
    if name.startswith(prefix):
        rest = name[len(prefix):].partition(".")[2]
        return f"*.{rest}"
    return name

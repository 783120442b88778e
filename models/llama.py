"""The reference plan for HF Llama-family models (Llama, Qwen2, Qwen3 dense), as layouts.

One declarative strategy, `{"dp": 2, "tp": 2, "sp": True}`, becomes a named mesh
and a parallelized `LlamaForCausalLM` (or `Qwen2ForCausalLM`, `Qwen3ForCausalLM`:
same module names). Tensor parallel is Megatron's: q, k, v, gate, up split by
output features, o and down by input features, the LM head by vocabulary (so
the loss runs vocab-parallel). With `sp`, the residual stream, norms and
dropout run on tokens split over tp (sequence parallel): the block inputs are
all-gathered and the block outputs reduce-scattered instead of all-reduced.
`cp` splits the sequence: attention runs context-parallel (`cp_algorithm`,
Ulysses by default, or ring), RoPE takes each rank's positions from the
replicated cos/sin. `dp` splits the batch.

Sequences under cp or sp (`_sequence_inputs`, a hook before the model's
forward): labels are shifted once on the whole sequence (passed as HF's
`shift_labels`, so the loss never shifts across a split); a sequence whose
length is not a multiple of the chunk count (cp, or 2 cp for ring; times tp
with sp) is right-padded to one with the pad token and label -100 (a given
padding mask with 0, given positions continued). Causal attention keeps real tokens blind
to that padding, so loss and gradients are unchanged; the returned logits
include the padded positions. Ring attention uses head-tail order
(`hp.ops.ring_attention.head_tail_order`): tokens, labels and RoPE's cos/sin
are permuted so that each rank does equal causal work, and the logits come
back in that order (`logits[:, argsort(order)]` restores it). Padding masks
and explicit `position_ids` are refused under cp (packed and padded batches
are not supported there yet). Parameter gradients are pending sums over
dp and cp (`+dp +cp`), reduced where the optimizer step reduces them
(`reduce_gradients`). With `fsdp`, FSDP2 shards the parameters over dp
instead and reduce-scatters their gradients (`_fully_shard`).
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hp
from hp import tp_plan
from hp.ops.context_parallel import ALGORITHMS
from hp.ops.ring_attention import head_tail_order
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
    """How to parallelize: data, context and tensor-parallel degrees, sequence parallel, FSDP on dp."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False
    cp_algorithm: str = "ulysses"
    fsdp: bool = False

    @classmethod
    def parse(cls, spec: Strategy | Mapping) -> Strategy:
        if isinstance(spec, Strategy):
            return spec
        known = ("dp", "cp", "tp", "sp", "cp_algorithm", "fsdp")
        unknown = set(spec) - set(known)
        if unknown:
            raise ValueError(f"strategy keys {sorted(unknown)} are not supported (known: {', '.join(known)})")
        algorithm = spec.get("cp_algorithm", "ulysses")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"strategy cp_algorithm {algorithm!r} is not one of {ALGORITHMS}")
        if spec.get("fsdp") and spec.get("cp", 1) > 1:
            raise ValueError("strategy fsdp with cp > 1 is not supported yet (use dp without fsdp alongside cp)")
        return cls(**spec)


def layouts(strategy: Strategy) -> tuple[dict[str, str], dict, dict]:
    """(parameter plan, input layouts, output layouts) for `hp.parallelize`.

    Only axes of size > 1 exist on the strategy's mesh (DTensor's redistribution
    planner slows down sharply with idle axes), so layouts name only those.
    """
    batch = "b/dp" if strategy.dp > 1 and not strategy.fsdp else "b"  # FSDP: each rank feeds its own batch
    seq = "s/cp" if strategy.cp > 1 else "s"
    split = batch != "b" or strategy.cp > 1
    tokens = f"{batch} {seq}"
    inputs = {"": {"input_ids": tokens, "labels": tokens, "shift_labels": tokens}} if split else {}
    residual = f"{batch} {seq}/tp h" if strategy.sp and strategy.tp > 1 else None
    outputs = {"model.embed_tokens": residual} if residual else {}
    return ({**TP_PLAN, **BIAS_PLAN} if strategy.tp > 1 else {}), inputs, outputs


def strategy_mesh(strategy: Strategy | Mapping, *, simulate: bool = False):
    """The mesh a strategy runs on: its dp, cp and tp axes of size > 1."""
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
    if strategy.fsdp and strategy.dp > 1:
        _fully_shard(model, mesh, strategy, _present(plan, model), outputs)
    else:
        hp.parallelize(model, mesh, _present(plan, model), inputs=inputs, outputs=outputs)
    if strategy.cp > 1:
        order = "head_tail" if strategy.cp_algorithm == "ring" else "contiguous"
        forward_inside(model, lambda: hp.context_parallel(strategy.cp_algorithm, order=order))
    if strategy.cp > 1 or (strategy.sp and strategy.tp > 1):
        _sequence_inputs(model, strategy)
    return model


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


_BATCHED = {"input_ids", "inputs_embeds", "labels", "shift_labels", "attention_mask", "position_ids"}


def _fully_shard(model: nn.Module, mesh, strategy: Strategy, plan: dict[str, str], outputs: dict) -> None:
    """FSDP2 over dp around the tp layout (on the mesh without dp); each decoder layer is one FSDP unit.

    Every rank still passes the global batch (as with plain dp) and keeps its dp slice. The
    loss is summed over the global count of labelled tokens (HF's `num_items_in_batch`), so the
    dp ranks' losses add up to one device's; FSDP averages gradients over dp (gloo has no
    pre-scaled sum), so the loss's gradient is scaled by dp to make them a sum. The loss comes
    back as a DTensor pending a sum over dp (`loss.full_tensor()` is the global one).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate

    inner = tuple(name for name in mesh.mesh_dim_names if name != "dp")
    if inner:
        hp.parallelize(model, mesh[inner], plan, outputs=outputs)
    units = [*model.model.layers, model]
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"])
    dp_rank, signature = mesh.get_local_rank("dp"), inspect.signature(model.forward)

    def before(mod, args, kwargs):
        kwargs = _as_keywords(signature, args, kwargs)
        if kwargs.get("shift_labels") is not None:  # already shifted (by _sequence_inputs)
            kwargs.setdefault("num_items_in_batch", int((kwargs["shift_labels"] != -100).sum()))
        elif kwargs.get("labels") is not None:
            kwargs.setdefault("num_items_in_batch", int((kwargs["labels"][:, 1:] != -100).sum()))
        for key in _BATCHED & kwargs.keys():
            if kwargs[key] is None:
                continue
            if kwargs[key].shape[0] % strategy.dp:
                raise ValueError(f"{key} has batch {kwargs[key].shape[0]}, not divisible by dp={strategy.dp}")
            kwargs[key] = kwargs[key].chunk(strategy.dp)[dp_rank]
        return (), kwargs

    def after(mod, args, kwargs, out):
        if getattr(out, "loss", None) is not None:
            local = out.loss.to_local() if isinstance(out.loss, DTensor) else out.loss
            local = _ScaleGradient.apply(local, strategy.dp)  # FSDP averages over dp; the loss is a sum
            placements = [Partial() if n == "dp" else Replicate() for n in mesh.mesh_dim_names]
            out.loss = DTensor.from_local(local, mesh, placements, run_check=False)
        return out

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    model.register_forward_hook(after, with_kwargs=True)


def _sequence_inputs(model: nn.Module, strategy: Strategy) -> None:
    """Shift labels once, pad the sequence to the chunk count, permute it for ring (module docstring).

    Chunks: cp (2 cp for ring) for the context split, times tp for sequence parallel.
    """
    cp, ring = strategy.cp > 1, strategy.cp > 1 and strategy.cp_algorithm == "ring"
    chunks = strategy.cp * (2 if ring else 1) * (strategy.tp if strategy.sp else 1)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    signature = inspect.signature(model.forward)

    def before(mod, args, kwargs):
        kwargs = _as_keywords(signature, args, kwargs)
        if cp:
            _refuse_what_cp_cannot_honour(kwargs)
        seq = next(kwargs[k].shape[1] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            kwargs["shift_labels"] = F.pad(kwargs["labels"][:, 1:], (0, 1), value=-100)
        extra = -seq % chunks
        order = head_tail_order(seq + extra, strategy.cp) if ring else None
        fills = {"input_ids": pad_id, "inputs_embeds": 0.0, "shift_labels": -100, "attention_mask": 0}
        for key, fill in fills.items():
            value = kwargs.get(key)
            if value is None:
                continue
            if extra:
                value = F.pad(value, (0, 0) * (value.ndim - 2) + (0, extra), value=fill)
            kwargs[key] = value if order is None else value[:, order.to(value.device)]
        if kwargs.get("position_ids") is not None and extra:  # the padding continues the positions
            last = kwargs["position_ids"][..., -1:]
            more = last + torch.arange(1, extra + 1, device=last.device)
            kwargs["position_ids"] = torch.cat([kwargs["position_ids"], more], dim=-1)
        if kwargs.get("shift_labels") is not None:
            kwargs["labels"] = kwargs["shift_labels"]  # HF computes the loss only when labels are given
        return (), kwargs

    def rotary(mod, args, out):  # cos and sin, (b, s, d), in the tokens' order
        return tuple(t[:, head_tail_order(t.shape[1], strategy.cp).to(t.device)] for t in out)

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    if ring:
        model.model.rotary_emb.register_forward_hook(rotary)


def _refuse_what_cp_cannot_honour(kwargs: dict) -> None:
    """Explicit positions and padding masks under cp; an all-ones mask is dropped (it masks nothing)."""
    if kwargs.get("position_ids") is not None:
        raise ValueError("position_ids are not supported under context parallelism (positions follow the tokens)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("padding masks are not supported under context parallelism: pack or trim the batch")


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


def _as_keywords(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A forward call's arguments, all by name (HF's `**kwargs` flattened in)."""
    named = dict(signature.bind_partial(*args, **kwargs).arguments)
    named.update(named.pop("kwargs", {}))
    return named


def _present(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The plan entries that match some parameter (the bias entries only on models with biases)."""
    names = [n for n, _ in model.named_parameters()]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}

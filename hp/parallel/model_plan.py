"""`hp.ModelPlan`: what is particular to one model family, as data.

A strategy (`hp.Strategy`) says how much of each parallelism to use; a model
plan says what that means for one family's modules: the tensor-parallel
layouts of its parameters (Megatron's, written in the layout notation), which
modules add their output to the residual stream (so their pending sums are
resolved into the stream's layout right there, whatever norm follows), and
where the decoder blocks, the embedding, the head and the rotary embedding
live, and for a mixture-of-experts family its experts modules and their
packed weights' layouts over the mesh axis `ep`. Everything else (the mesh, FSDP, sequence preparation, gradient
reduction, batch slicing) is the same for every family and lives in
`hp.apply_strategy`. A plan is torch-free and compares by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class ModelPlan:
    """One family's layouts and module names.

    `params` maps parameter-name globs to layouts for tensor parallel over the
    mesh axis `tp` (first match wins; entries that match nothing in a given
    model, such as optional biases, are skipped). `residual` lists globs of
    modules whose output joins the residual stream (the row-parallel
    projections). `blocks` is the `nn.ModuleList` of decoder layers (one FSDP
    unit each), `embedding` the token embedding, `norm` the norm after the
    blocks and `head` the module that makes the logits (pipeline parallel
    cuts the model between them), `rotary` the module that
    returns RoPE's `(cos, sin)` (permuted with the tokens under ring
    attention; None when the family has none). `experts` lists globs of the
    experts modules (called `experts(tokens, expert_ids, weights)`, as HF's
    are), which run expert parallel by their layouts; `expert_params` lays
    out their packed weights over `ep` (applied when ep > 1); `routers` names
    the modules that choose each token's experts (softmax top-k routers,
    for the strategy's auxiliary-loss-free balancing). `vision` is a
    vision-language family's vision tower, replicated over the decoder's ranks
    (one FSDP unit of its own), and `decoder` its language model: the model
    embeds the text, scatters the tower's output into it and computes the
    positions on the whole sequence, so the residual stream starts at the
    decoder's `inputs_embeds`, and that is where the sequence splits.
    `projector` lists the tower's modules that map its output into the
    decoder's width (LlamaFactory's multi-modal projector, frozen apart from
    the rest of the tower). `vision_params` and `vision_residual` are the tower's own tensor-parallel
    layouts and residual modules, used when the strategy splits the tower
    over tp too (`Strategy.vision_tp`). `rowwise` lists globs of modules that
    mix values only along their input's last dim (the norms), and
    `rowwise_functions` names functions of the decoder blocks' modeling module
    that do too and are called `f(q, k, ...) -> (q', k')` (HF's
    `apply_rotary_pos_emb`): both run on each rank's block wherever that dim
    is whole (`hp.ops.blockwise`). `unsplit` names a layer of the family that
    hp cannot split over tp or cp yet (a state-space or linear-attention
    layer, a short convolution): such a family runs under dp and FSDP only.

    >>> import hp
    >>> plan = hp.ModelPlan(params={"*.q_proj.weight": "out/tp in"}, residual=("*.o_proj",))
    >>> plan.blocks, plan.params["*.q_proj.weight"]
    ('model.layers', 'out/tp in')
    """

    params: Mapping[str, str]
    residual: tuple[str, ...] = ()
    blocks: str = "model.layers"
    embedding: str = "model.embed_tokens"
    norm: str | None = "model.norm"
    head: str | None = "lm_head"
    rotary: str | None = "model.rotary_emb"
    experts: tuple[str, ...] = ()
    expert_params: Mapping[str, str] = field(default_factory=dict)
    routers: tuple[str, ...] = ()
    vision: str | None = None
    decoder: str | None = None
    projector: tuple[str, ...] = ()
    vision_params: Mapping[str, str] = field(default_factory=dict)
    vision_residual: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ("*norm",)
    rowwise_functions: tuple[str, ...] = ("apply_rotary_pos_emb",)
    unsplit: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "residual", tuple(self.residual))
        object.__setattr__(self, "experts", tuple(self.experts))
        object.__setattr__(self, "routers", tuple(self.routers))
        object.__setattr__(self, "expert_params", MappingProxyType(dict(self.expert_params)))
        object.__setattr__(self, "vision_params", MappingProxyType(dict(self.vision_params)))
        object.__setattr__(self, "vision_residual", tuple(self.vision_residual))
        object.__setattr__(self, "projector", tuple(self.projector))
        object.__setattr__(self, "rowwise", tuple(self.rowwise))
        object.__setattr__(self, "rowwise_functions", tuple(self.rowwise_functions))

    def __hash__(self) -> int:
        return hash((tuple(self.params.items()), self.residual, self.blocks, self.embedding, self.rotary,
                     self.experts, tuple(self.expert_params.items()), self.routers, self.vision, self.decoder,
                     tuple(self.vision_params.items()), self.vision_residual, self.projector, self.rowwise,
                     self.rowwise_functions, self.unsplit))


def held_blocks(model: Any, plan: ModelPlan) -> list:
    """The plan's decoder blocks that `model` holds: a pipeline stage keeps the others' places with
    parameter-less stand-ins, which no layout, FSDP unit or compiled graph needs.

    >>> import torch
    >>> model = torch.nn.Module()
    >>> model.layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Linear(2, 2)])
    >>> held_blocks(model, ModelPlan(params={}, blocks="layers"))
    [Linear(in_features=2, out_features=2, bias=True)]
    """
    return [b for b in model.get_submodule(plan.blocks) if next(b.parameters(), None) is not None]

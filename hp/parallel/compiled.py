"""`hp.compile_blocks`, `hp.compile_loss`: a laid-out model's decoder blocks and its loss under `torch.compile`.

Why: a laid-out step is bound by host-side dispatch (Python, DTensor's
sharding propagation, autograd bookkeeping) long before its kernels on an
accelerator. Compiled, a block pays that once, when dynamo traces it; each
step then runs the block's forward and backward as two graphs whose
collectives are functional ops.

Choices, as torchtitan makes them:

- Per block, not the whole model: every decoder layer runs the same code, so
  one graph serves them all (the parameters are inputs), and compile time
  does not grow with depth.
- The block's `forward` is compiled, not its `__call__`: module hooks stay
  eager around it (FSDP2's gathers and reshards, hp's layouts at the block's
  boundary, `hp.parallel.recompute`'s checkpoint around the compiled forward), while
  the layouts of the modules inside are traced with it.
- `fullgraph=True`: a graph break inside a block is an error naming the line,
  not a silent fall back to eager.
- The loss is compiled too (torchtitan's "model" and "loss" components): a
  causal LM's loss reads the (N, V) logits, the largest activation of the
  step, in a chain of elementwise passes (the float cast, the row max, the
  exponentials, the softmax that backward needs); one graph fuses them,
  collectives included when the vocabulary is split. On a 2-rank tp step of
  a 512-hidden Llama that chain cost about a tenth of the step eagerly.

What hp's kernels and layouts do under tracing: layouts are parsed and bound
once, when a call is traced (`hp.constrain` keeps the placements as a
constant of the graph); blocks move between local tensors and DTensors
through DTensor's own `from_local` / `to_local`; the context-parallel choice
and the active rules are module globals that dynamo guards on.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def compile_blocks(blocks: Iterable[nn.Module], *, backend: str = "inductor") -> None:
    """Compile each of `blocks` (a model's decoder layers, say) in place, `fullgraph=True`.

    `backend` is `torch.compile`'s ("inductor" generates kernels; "aot_eager" traces forward
    and backward the same way and runs them eagerly, which is quicker to compile).

    >>> import torch
    >>> layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> compile_blocks(layers, backend="eager")
    >>> layers[0](torch.ones(1, 2)).shape
    torch.Size([1, 2])
    >>> is_compiled(layers[1])
    True
    """
    for block in blocks:
        # the instance's forward as it is now (hp.parallel.recompute may have replaced it)
        block.forward = _compiled(block.forward, backend)


def compile_loss(model: nn.Module, *, backend: str = "inductor") -> bool:
    """Compile `model`'s loss function in place, `fullgraph=True`; whether it has one to compile.

    An HF model's `loss_function` (the logits' float cast, the label shift, the cross-entropy,
    hp's vocab-parallel kernel where the logits are split by vocabulary) becomes one compiled
    graph for this model; other models are left as they are.

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from hp.models import tiny_config
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> compile_loss(model, backend="eager")
    True
    >>> ids = torch.randint(0, 256, (2, 8))
    >>> model(input_ids=ids, labels=ids).loss.shape
    torch.Size([])
    >>> compile_loss(torch.nn.Linear(2, 2))
    False
    """
    loss = getattr(model, "loss_function", None)
    if loss is None:
        return False
    model.loss_function = _compiled(loss, backend)
    return True


def _compiled(fn, backend: str):
    """`fn` under `torch.compile(fullgraph=True)`, or `fn` itself when it already is."""
    return fn if _is_compiled_fn(fn) else torch.compile(fn, fullgraph=True, backend=backend)


def _is_compiled_fn(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")


def is_compiled(block: nn.Module) -> bool:
    """Whether `compile_blocks` compiled `block`'s forward.

    >>> is_compiled(torch.nn.Linear(2, 2))
    False
    """
    return _is_compiled_fn(block.__dict__.get("forward"))

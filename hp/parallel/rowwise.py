"""A model's row-wise modules and functions (norms, RoPE) run on each rank's block.

Norms and rotary embeddings mix values only along the hidden (or head) dim,
which the layouts of tensor, sequence and context parallel keep whole, so
each rank can compute its block of them as plain tensors
(`hp.ops.blockwise`) instead of paying DTensor's propagation for each of
their ops. The plan names them: module globs (`ModelPlan.rowwise`, the
norms) and functions of the decoder's modeling module
(`ModelPlan.rowwise_functions`, HF's `apply_rotary_pos_emb`). A function is
replaced in its module once per process; called on plain tensors the
replacement is the function itself.
"""

from __future__ import annotations

import fnmatch
import sys
import types

from torch import nn

from hp.parallel.model_plan import ModelPlan, held_blocks
from hp.ops.blockwise import blockwise


def run_rowwise(model: nn.Module, plan: ModelPlan) -> None:
    """Run the modules and functions `plan` calls row-wise on each rank's block (module docstring).

    >>> import hp
    >>> from hp.models import plan_for, tiny_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    >>> run_rowwise(model, plan_for(model.config))
    >>> hasattr(model.model.norm.forward, "hp_blockwise")
    True
    """
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, g) for g in plan.rowwise) and not hasattr(module.forward, "hp_blockwise"):
            # bound to the module (a deep copy rebinds it); the input is the argument after self
            module.forward = types.MethodType(blockwise(type(module).forward, like=(1,)), module)
    blocks = held_blocks(model, plan)
    modeling = sys.modules[type(blocks[0]).__module__] if blocks else None
    for name in plan.rowwise_functions if modeling is not None else ():
        function = getattr(modeling, name, None)
        if callable(function) and not hasattr(function, "hp_blockwise"):
            setattr(modeling, name, blockwise(function, like=(0, 1)))

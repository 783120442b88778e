"""The layers hp cannot split over tp, cp or ep yet, found by their class names.

A family built of attention and MLP blocks splits by its derived plan. Some
families also hold layers whose state runs along the sequence or whose
weights hp has no rule for: state-space (Mamba) mixers, linear attention
(gated delta nets, lightning attention), short convolutions, and attention
that first picks a sparse set of keys with an indexer. Such a family still
trains under dp and FSDP, which never split a layer's computation; under
tp, cp or ep it is refused before any worker starts, with the layer named.
"""

from __future__ import annotations

import re

# A class-name pattern and what such a layer is, in words.
KINDS = (
    (re.compile(r"Mamba|Mixer$|SSM"), "state-space (Mamba)"),
    (re.compile(r"GatedDeltaNet|DeltaNet|LinearAttention|Lightning|KimiDelta"), "linear-attention"),
    (re.compile(r"ShortConv|Conv1d$|CausalConv"), "short-convolution"),
    (re.compile(r"Indexer"), "sparse indexed attention"),
)


def unsplit_layer(model) -> str | None:
    """'<kind> (<class name>)' for the first block layer hp cannot split, or None.

    >>> from hp.models import tiny_config
    >>> from hp.models.derive import meta_model
    >>> unsplit_layer(meta_model(tiny_config("llama"))) is None
    True
    """
    for module in model.modules():
        name = type(module).__name__
        for pattern, kind in KINDS:
            if pattern.search(name):
                return f"{kind} ({name})"
    return None

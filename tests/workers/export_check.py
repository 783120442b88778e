"""For test_train.py: the exported HF directory gives the checkpoint's logits.

Loads the checkpoint's weights (saved at tp=2) into the unsharded model of its
config.json with hp's reader, loads the export with plain `transformers`, and
prints the largest logit difference on a random batch as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hp.train.checkpoint import load_model_weights


def main(checkpoint: str, exported: str) -> None:
    mine = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    load_model_weights(checkpoint, mine)
    theirs = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (mine(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max().item()
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    trained = any(not torch.equal(a, b) for a, b in zip(fresh.parameters(), theirs.parameters()))
    assert trained, "the export holds freshly initialised weights"
    print(json.dumps({"max_abs_diff": diff}))


if __name__ == "__main__":
    main(*sys.argv[1:])

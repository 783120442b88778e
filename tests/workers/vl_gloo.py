"""Worker for test_gloo.py: the Qwen-VL families on 2 real gloo processes, with images.

What the simulated ranks of test_qwen_vl.py cannot run: FSDP (the vision
tower one unit of its own, its gradients pending over dp and cp so that
FSDP's summing reduce-scatter counts each once), and HF's own M-RoPE
positions (`get_rope_index` on real tensors: the batch carries no
position_ids). Qwen2.5-VL under dp=2 with FSDP for 5 AdamW steps, Qwen3-VL
(deepstack features) under cp=2 ring attention with FSDP over cp, and
Qwen3-VL-MoE under expert parallel with FSDP (dp=2 of which ep=2), its
images all in the first rank's samples: the loss and every gradient, vision
tower included, equal HF's unsharded model, and each rank's tower reads its
own samples' images only (a blank one where it has none). Every check
raises on failure.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForImageTextToText

import hp
from hp.models import plan_for, tiny_config, tiny_vl_batch
from hp.models.tiny import TINY_IMAGES


def check(family: str, strategy: dict, rank: int, steps: int, images=TINY_IMAGES) -> None:
    torch.manual_seed(0)
    config = tiny_config(family, layers=1)
    reference, model = AutoModelForImageTextToText.from_config(config), AutoModelForImageTextToText.from_config(config)
    model.load_state_dict(reference.state_dict())
    batches = [tiny_vl_batch(reference, images, seq=32, seed=s) for s in range(steps)]
    for batch in batches:
        del batch["position_ids"]  # HF computes them from mm_token_type_ids, as in training
    mesh = hp.strategy_mesh(strategy)
    hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
    encoded = []  # the patches the tower reads: a rank of dp or ep reads its own samples' images only
    model.model.visual.register_forward_pre_hook(lambda mod, args: encoded.append(args[0].shape[0]))
    half = len(images) // 2
    split = hp.Strategy.of(strategy).batch_axes
    own = images[half * rank:half * (rank + 1)] if split else images
    patches = sum(h * w // 16 for sample in own for h, w in sample) or 4  # 4-pixel patches; a blank image: 2 x 2
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch in enumerate(batches):
        where = f"rank {rank} {family} {strategy} step {step}"
        want = reference(**batch).loss
        want.backward()
        got = model(**batch).loss
        assert encoded[-1] == patches, f"{where}: the tower read {encoded[-1]} patches, expected {patches}"
        got.backward()
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=where)
        hp.reduce_gradients(model)
        if step == 0:
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7, msg=f"{where}: {name}")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def main() -> None:
    rank = int(os.environ["RANK"])
    check("qwen2_5_vl", {"dp": 2, "fsdp": True}, rank, steps=5)
    check("qwen3_vl", {"cp": 2, "cp_algorithm": "ring", "fsdp": True}, rank, steps=1)
    # rank 1's samples hold no image: it encodes a blank one, for FSDP's collectives and backward
    check("qwen3_vl_moe", {"dp": 2, "ep": 2, "fsdp": True}, rank, steps=5, images=(((16, 16),), (), (), ()))
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()

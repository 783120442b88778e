"""Worker for test_pipeline.py: pipeline parallel on gloo ranks against the unsharded model (on 8 ranks, 2D
tensor parallel within pipeline stages and within FSDP too).

For every schedule of `torch.distributed.pipelining` that hp names, a tiny Llama cut into stages over
`pp`: the step's loss and every gradient equal the unsharded step's over the same tokens (fp32,
relative 1e-5), with `-100` labels spread unevenly over the micro-batches (one micro-batch has none
supervised but one token), and under cp a length its chunks do not divide. Every check raises on
failure.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

import hp
from hp.models import plan_for, tiny_config
from hp.parallel.pipeline import V_SCHEDULES, pipeline

FAMILIES = ["qwen3_moe", "gemma2", "gpt_neox"]
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def batch(rows: int = 8, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 2] = -100  # prompts
    labels[1, :] = -100
    labels[1, -1] = ids[1, -1]  # a row with one supervised token
    labels[5, 3:] = -100
    return ids, labels


def check(strategy: dict, where: str, family: str = "llama", seq: int = 16) -> None:
    torch.manual_seed(0)
    config = tiny_config(family, layers=4)
    reference = AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    ids, labels = batch(seq=seq)
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy)
    pipe = pipeline(model, mesh, strategy, plan_for(config))
    got = pipe.step(ids, labels)
    for stage in pipe.stages:
        hp.reduce_gradients(stage)
    rel = abs(got.item() - want.item()) / want.item()
    assert rel < 1e-5, f"{where}: loss {got.item()} vs unsharded {want.item()} ({rel:.1e})"
    grads = dict(reference.named_parameters(remove_duplicate=False))  # a tied head is the last stage's copy
    seen = 0
    for name, p in pipe.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = ((g - grads[name].grad).norm() / grads[name].grad.norm()).item()
        assert err < 1e-5, f"{where}: gradient of {name} off by {err:.1e}"
        seen += 1
    assert seen, f"{where}: this rank holds no parameters"


# pp with the other axes on 4 ranks: each stage laid out on a 2-rank mesh
COMPOSED = [{"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2}, {"dp": 2, "fsdp": True}, {"cp": 2},
            {"cp": 2, "cp_algorithm": "ring"}]


def lengths_vary(schedule: str) -> None:
    """Batches of other lengths after the first: each gets a schedule of its own, and the unsharded loss;
    so does an evaluation of a batch whose rows do not fill the micro-batches."""
    torch.manual_seed(0)
    config = tiny_config("llama", layers=4)
    reference, model = (AutoModelForCausalLM.from_config(config) for _ in range(2))
    model.load_state_dict(reference.state_dict())
    strategy = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": 4}
    pipe = pipeline(model, hp.strategy_mesh(strategy), strategy, plan_for(config))
    for seq in (16, 24, 16, 12):
        ids, labels = batch(seq=seq)
        got, want = pipe.step(ids, labels).item(), reference(input_ids=ids, labels=labels).loss.item()
        assert abs(got - want) / want < 1e-5, f"{schedule} at {seq} tokens: loss {got} vs unsharded {want}"
    if schedule in V_SCHEDULES:
        return
    ids, labels = (t[:7] for t in batch(seq=20))  # evaluated: forward only, rows padded to whole micro-batches
    got, want = pipe.evaluate(ids, labels).item(), reference(input_ids=ids, labels=labels).loss.item()
    assert abs(got - want) / want < 1e-5, f"{schedule} evaluating 7 rows: loss {got} vs unsharded {want}"


def check_laid_out(strategy: dict, where: str) -> None:
    """A step of the whole model laid out by `strategy` (no pipeline) against the unsharded one."""
    torch.manual_seed(0)
    config = tiny_config("llama", layers=2)
    reference = AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    ids, labels = batch()
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy)
    hp.apply_strategy(model, mesh, strategy, plan_for(config))
    got = model(input_ids=ids, labels=labels).loss
    got.backward()
    hp.reduce_gradients(model)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    assert abs(got.item() - want.item()) / want.item() < 1e-5, f"{where}: loss {got.item()} vs {want.item()}"
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = ((g - r.grad).norm() / r.grad.norm()).item()
        assert err < 1e-5, f"{where}: gradient of {name} off by {err:.1e}"


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    if world == 8:  # 2D tensor parallel (2 x 2) within pipeline stages, and within FSDP over dp
        two_d = {"tp2d": {"x": 2, "y": 2}}
        check({"pp": 2, "pp_microbatches": 2, **two_d}, "pp=2 x tp2d 2x2")
        check_laid_out({"dp": 2, "fsdp": True, **two_d}, "fsdp dp=2 x tp2d 2x2")
    elif world == 2:
        for schedule in SCHEDULES:
            check({"pp": 2, "pp_schedule": schedule, "pp_microbatches": 4}, f"pp=2 {schedule}")
        for schedule in ("1F1B", "ZBVZeroBubble"):
            lengths_vary(schedule)
        for family in FAMILIES:
            check({"pp": 2, "pp_microbatches": 4}, f"{family} pp=2", family)
    else:
        for inner in COMPOSED:
            for schedule in ("1F1B", "Interleaved1F1B" if inner.get("fsdp") else "ZBVZeroBubble"):
                strategy = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": 4, **inner}
                check(strategy, f"{strategy}", seq=15 if "cp" in inner else 16)  # cp: padded to its chunks
        check({"pp": 2, "dp": 2, "ep": 2, "pp_microbatches": 4}, "qwen3_moe pp=2 ep=2", "qwen3_moe")
    print(f"rank {os.environ['RANK']}: pipelines follow the unsharded model", flush=True)


if __name__ == "__main__":
    main()

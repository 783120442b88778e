"""hp.offload on a Llama step where activations dominate: memory against budget, bytes moved, time.

Why: `hp.offload` promises a step that stays under a memory budget by moving
only what the budget requires, and early enough not to wait. This measures
that promise against the two usual answers: moving every saved activation
out and back (what `torch.autograd.graph.save_on_cpu` does; on CPU the host
is the device, so here "everything" goes to the same disk tier hp uses),
and recomputing every decoder layer in backward (`hp.parallel.recompute`).

One HF `LlamaForCausalLM` (hidden 256, 4 layers, 8 / 4 heads, ffn 688,
vocabulary 1024; fp32; batch 4 x 512 tokens; AdamW), one process, CPU (on
an accelerator the host tier would apply; it is not built yet). Configurations,
each on its own copy of the same weights:

- `none`: the step as it is;
- `hp_75`, `hp_50`, `hp_30`: `hp.offload(step, budget=B, recompute=layers)`
  with B 75%, 50% and 30% of `none`'s peak as hp's ledger records it (every
  storage the step makes, state that outlives it left out); the planner may
  recompute a decoder layer where that costs less than its moves;
- `everything`: saved-tensor hooks that write every saved activation to the
  disk tier and read it back when autograd needs it (no plan, no prefetch);
- `recompute`: each decoder layer recomputed in backward.

Per configuration: the median step time of interleaved rounds; bytes moved
(written out plus read back); the peak two ways: hp's ledger (`none`: the
recording; `hp_*`: the plan's peak after, and the largest saved-activation
bytes resident while running) and measured from outside the library: the
process's resident memory (RSS, sampled every 0.2 ms on a thread) at its
highest during the step above what it held just before, with glibc told to
return every block over 128 KiB to the system when freed
(`MALLOC_MMAP_THRESHOLD_`); the disk tier never maps its files, so their
pages are the kernel's, not the process's.

Summary (last line): `peak_over_budget_50` = measured peak of `hp_50` /
its budget; `bytes_vs_save_on_cpu_50` = bytes `hp_50` moves / bytes
`everything` moves; `time_vs_recompute_50` = `hp_50`'s step time /
`recompute`'s. About two minutes on 2 CPU cores.

    python benchmarks/offload.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

SHAPE = dict(vocab=1024, hidden=256, ffn=688, layers=4, heads=8, kv_heads=4, batch=4, seq=512)
FRACTIONS = {"hp_75": 0.75, "hp_50": 0.5, "hp_30": 0.3}
_THRESHOLD = "131072"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps per configuration")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != _THRESHOLD:  # glibc reads it at start: run again with it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = _THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])
    started = time.perf_counter()
    records = run(args.reps)
    for record in records:
        print(json.dumps(record), flush=True)
    summary = summarize(records)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)


def run(reps: int) -> list[dict]:
    import hp
    from hp.parallel.recompute import recompute_blocks
    from hp.offload.use_def import record

    ids = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]), generator=torch.Generator().manual_seed(0))
    models = {name: _model() for name in ("none", *FRACTIONS, "everything", "recompute")}
    steps = {name: _training(model) for name, model in models.items()}
    # the budgets: fractions of the plain step's peak as hp's ledger records it (one step of a copy)
    probe = _model()
    _, recording = record(_training(probe), (ids,), {}, (probe,))
    peak = recording.step_peak_bytes
    budgets = {name: int(f * peak) for name, f in FRACTIONS.items()}
    for name, budget in budgets.items():
        steps[name] = hp.offload(steps[name], budget=budget, modules=[models[name]],
                                 recompute=models[name].model.layers)
    everything = _Everything()
    steps["everything"] = everything.wrap(steps["everything"])
    recompute_blocks(models["recompute"].model.layers)

    # warm-up: hp records and plans, and records again after each recompute choice or back-out;
    # every configuration takes as many steps, so that their losses compare
    losses: dict[str, list[float]] = {name: [] for name in steps}
    while not losses["none"] or not all(steps[name].settled for name in FRACTIONS):
        for name, step in steps.items():
            losses[name].append(step(ids))
    for name, got in losses.items():
        if got != losses["none"]:
            raise AssertionError(f"{name}: losses {got} differ from the plain step's {losses['none']}")
    times: dict[str, list[float]] = {name: [] for name in steps}
    rss: dict[str, list[int]] = {name: [] for name in steps}
    moved: dict[str, int] = {}
    for r in range(reps):
        names = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for name in names:
            everything.moved = 0
            seconds, high = _measured(steps[name], ids)
            times[name].append(seconds)
            rss[name].append(high)
            moved[name] = steps[name].last_run.bytes_moved if name in FRACTIONS else everything.moved
    records = []
    for name in steps:
        record_ = {"bench": "offload", "config": name, "median_s": round(statistics.median(times[name]), 4),
                   "bytes_moved": moved.get(name, 0), "measured_peak_bytes": max(rss[name]),
                   "budget_bytes": budgets.get(name)}
        if name in FRACTIONS:
            plan, last = steps[name].plan(), steps[name].last_run
            record_.update(ledger_peak_bytes=plan.peak_after, ledger_peak_before=plan.peak_before,
                           over_budget_bytes=plan.over_budget_bytes, expected_stall_s=round(plan.stall_s, 4),
                           recomputed=list(plan.recompute),
                           resident_activation_peak=last.peak_resident_bytes)
        elif name == "none":
            record_.update(ledger_peak_bytes=peak)
        records.append(record_)
    return records


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"], max_position_embeddings=SHAPE["seq"], use_cache=False,
    ))


def _training(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


class _Everything:
    """Every saved activation to the disk tier and back when needed (save_on_cpu's policy)."""

    def __init__(self) -> None:
        from hp.offload.tiers import DiskTier

        self.tier, self.moved = DiskTier(), 0

    def wrap(self, step):
        def offloaded(*args):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return step(*args)

        return offloaded

    def pack(self, t: torch.Tensor):
        if t.is_leaf and t.requires_grad or t._base is not None and t._base.is_leaf and t._base.requires_grad:
            return t  # a parameter (or a view of one): its owner holds it anyway
        self.moved += t.untyped_storage().nbytes()
        return self.tier.put(t.untyped_storage()), t.storage_offset(), t.shape, t.stride(), t.dtype

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        key, offset, shape, stride, dtype = packed
        storage = self.tier.take(key)
        self.moved += storage.nbytes()
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measured(step, ids) -> tuple[float, int]:
    """(seconds, the highest RSS during the step above RSS just before it)."""
    before, high, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            high[0] = max(high[0], _rss())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    step(ids)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return seconds, max(high[0], _rss()) - before


def summarize(records: list[dict]) -> dict:
    by = {r["config"]: r for r in records}
    half = by["hp_50"]
    return {
        "summary": True,
        "median_s": {name: r["median_s"] for name, r in by.items()},
        "measured_peak_bytes": {name: r["measured_peak_bytes"] for name, r in by.items()},
        "bytes_moved": {name: r["bytes_moved"] for name, r in by.items()},
        "peak_over_budget_50": round(half["measured_peak_bytes"] / half["budget_bytes"], 4),
        "bytes_vs_save_on_cpu_50": round(half["bytes_moved"] / by["everything"]["bytes_moved"], 4),
        "time_vs_recompute_50": round(half["median_s"] / by["recompute"]["median_s"], 4),
        "inputs": SHAPE,
    }


if __name__ == "__main__":
    main()

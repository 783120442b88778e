"""hp's step on an accelerator: plain HF against hp's layout, eager and compiled, on one device.

Why: on a GPU or NPU a laid-out step is bound by host-side dispatch before
any communication, so the figures that decide hp's speed there are these:
plain HF eager, the same model laid out by hp (the Llama plan at tp=2 on a
one-rank mesh: everything laid out, nothing to move), plain HF with each
decoder layer under `torch.compile`, and hp with `compile=True` (each layer
and the loss under `torch.compile(fullgraph=True)`). One step is forward
with labels, backward and AdamW's multi-tensor step, bf16 parameters.

The default model is a 0.9B Llama (hidden 2048, 16 layers, 16 heads / 8 KV
heads, ffn 5632, vocabulary 32000) at 2048 tokens, batches 2 and 8; each
configuration is built alone (the device holds one model and its optimizer
at a time), takes `--warmup` steps, then `--steps` timed ones between
device synchronizations; its median is reported. The first step's loss of
every configuration must equal plain eager's (bf16: relative 2e-2), or the
run stops. Last line, the summary: `hp_eager_vs_plain_b2` (hp eager / plain
eager at batch 2, target <= 1.10) and `hp_compiled_vs_plain_compiled_b8`
(target <= 1.05), plus `device`, `torch` and the date.

    python benchmarks/accelerator_step.py                    # on a GPU or NPU: about 5 minutes on an H200
    python benchmarks/accelerator_step.py --shape tiny       # the same code on CPU, in seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
from overhead import train_step

SHAPES = {
    "0.9b": dict(vocab=32000, hidden=2048, ffn=5632, layers=16, heads=16, kv_heads=8, seq=2048, batches=(2, 8)),
    "tiny": dict(vocab=256, hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, seq=64, batches=(2, 8)),
}
CONFIGS = ("plain", "hp", "plain_compiled", "hp_compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.9b")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration (compiling included)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    args = parser.parse_args()
    import hp
    from hp.device import detect

    device = torch.device(detect().type)
    if device.type == "cpu" and args.shape != "tiny":
        raise SystemExit("accelerator_step.py: no accelerator here; run with --shape tiny to check the script on CPU")
    shape = SHAPES[args.shape]
    mesh = hp.mesh(tp=1)
    medians: dict[tuple[str, int], float] = {}
    for batch in shape["batches"]:
        ids = torch.randint(0, shape["vocab"], (batch, shape["seq"]), generator=torch.Generator().manual_seed(batch))
        first = {}
        for name in CONFIGS:
            seconds, first[name] = _measure(name, shape, ids.to(device), mesh, device, args.warmup, args.steps)
            medians[name, batch] = statistics.median(seconds)
            rel = abs(first[name] - first["plain"]) / abs(first["plain"])
            if rel > 2e-2:
                raise AssertionError(f"{name} at batch {batch}: first loss {first[name]} vs plain {first['plain']}")
            print(json.dumps({"bench": "accelerator_step", "config": name, "batch": batch,
                              "median_s": round(medians[name, batch], 4), "min_s": round(min(seconds), 4),
                              "tokens_per_s": round(batch * shape["seq"] / medians[name, batch]),
                              "first_loss": round(first[name], 4)}), flush=True)
    low, high = shape["batches"]

    def ratio(mine: str, theirs: str, batch: int) -> float:
        return round(medians[mine, batch] / medians[theirs, batch], 3)

    print(json.dumps({
        "summary": True, "shape": args.shape, "device": _device_name(device), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        f"hp_eager_vs_plain_b{low}": ratio("hp", "plain", low),
        f"hp_compiled_vs_plain_compiled_b{high}": ratio("hp_compiled", "plain_compiled", high),
        f"hp_compiled_vs_plain_b{high}": ratio("hp_compiled", "plain", high),
    }), flush=True)


def _measure(name: str, shape: dict, ids: torch.Tensor, mesh, device: torch.device, warmup: int,
             steps: int) -> tuple[list[float], float]:
    """(timed step seconds, the first step's loss) of configuration `name`, built alone on `device`."""
    model = _model(name, shape, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    first = train_step(model, optimizer, ids)
    for _ in range(warmup - 1):
        train_step(model, optimizer, ids)
    seconds = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        train_step(model, optimizer, ids)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    del model, optimizer
    if device.type != "cpu" and hasattr(torch.accelerator, "empty_cache"):
        torch.accelerator.empty_cache()  # the next configuration gets the whole device
    return seconds, first


def _model(name: str, shape: dict, mesh, device: torch.device):
    import hp
    from hp.models import plan_for
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["seq"], use_cache=False,
    )
    torch.manual_seed(0)
    torch._dynamo.reset()  # each configuration compiles as its own job
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if name == "plain_compiled":
        for layer in model.model.layers:
            layer.compile()
    elif name.startswith("hp"):
        model = hp.apply_strategy(model, mesh, {"tp": 2, "compile": name == "hp_compiled"}, plan_for(config))
    return model


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    return device.type


if __name__ == "__main__":
    main()

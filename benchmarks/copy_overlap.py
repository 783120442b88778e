"""How much of a collective's time a GPU or NPU can hide under a layer's matmuls: the one-device stand-in.

Why: `hp.mpmd` hides tensor-parallel collectives behind other chunks'
compute. With two or more devices that is measured on nccl / hccl; with one,
the question left is whether the device runs a copy engine's transfer
while its cores run the layer. So a device-to-host copy of the bytes a
Llama layer's tp collective moves (one activation, batch x seq x hidden,
bf16) stands in for the collective, on a side stream into pinned host
memory, beside the layer's matmuls (q, k, v, o, gate, up, down at tp=1) on
the default stream.

Figures (medians of `--reps`, each between device synchronizations): the
matmuls alone, the copy alone, both issued together; `overlap` = (matmuls +
copy - both) / min(matmuls, copy): 1 when the shorter hides entirely under
the longer, 0 when they run one after the other. Last line: `overlap`,
`copy_gbps`, `device`, `torch`, the date.

    python benchmarks/copy_overlap.py                 # on a GPU or NPU, seconds
    python benchmarks/copy_overlap.py --shape tiny    # the same code on CPU (no copy engine: overlap ~0)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

SHAPES = {"0.9b": dict(hidden=2048, ffn=5632, tokens=8 * 2048), "tiny": dict(hidden=256, ffn=688, tokens=2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.9b")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    accel = torch.accelerator.is_available()
    if not accel and args.shape != "tiny":
        raise SystemExit("copy_overlap.py: no accelerator here; run with --shape tiny to check the script on CPU")
    device = torch.accelerator.current_accelerator() if accel else torch.device("cpu")
    module = torch.get_device_module(device)
    dtype = torch.bfloat16
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=dtype)
    weights = [torch.randn(n, shape["hidden"], device=device, dtype=dtype) / shape["hidden"] ** 0.5
               for n in (shape["hidden"],) * 4 + (shape["ffn"],) * 2]
    down = torch.randn(shape["hidden"], shape["ffn"], device=device, dtype=dtype) / shape["ffn"] ** 0.5
    host = torch.empty(x.shape, dtype=dtype, pin_memory=accel)
    side = module.Stream()

    def matmuls() -> None:
        outs = [x @ w.T for w in weights]
        (outs[-1] * outs[-2]) @ down.T

    def copy() -> None:
        with module.stream(side):
            host.copy_(x, non_blocking=accel)

    def timed(*work) -> float:
        module.synchronize()
        start = time.perf_counter()
        for w in work:
            w()
        module.synchronize()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up: kernels chosen, pages pinned
        timed(copy, matmuls)
    rounds = [(timed(matmuls), timed(copy), timed(copy, matmuls)) for _ in range(args.reps)]
    mm, cp, both = (statistics.median(r[i] for r in rounds) for i in range(3))
    overlap = (mm + cp - both) / min(mm, cp)
    record = {"bench": "copy_overlap", "shape": args.shape, "matmuls_ms": round(mm * 1e3, 3),
              "copy_ms": round(cp * 1e3, 3), "both_ms": round(both * 1e3, 3), "bytes": x.numel() * x.element_size()}
    print(json.dumps(record), flush=True)
    print(json.dumps({"summary": True, "overlap": round(overlap, 3),
                      "copy_gbps": round(x.numel() * x.element_size() / cp / 1e9, 2),
                      "device": module.get_device_name() if accel else "cpu", "torch": torch.__version__,
                      "date": datetime.date.today().isoformat()}), flush=True)


if __name__ == "__main__":
    main()

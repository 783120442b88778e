"""Annotate-and-run: a Megatron-style tensor-parallel MLP written only with layouts.

The model code is ordinary PyTorch; the layouts on the weights say what is
split, DTensor's op rules propagate them, and one `hp.constrain` says where
the partial sum is reduced. The script checks loss and gradients against the
same MLP on one device and prints one JSON object as its last line.

    python examples/annotate_mlp.py --simulate 4          # 4 ranks in one process
    torchrun --nproc-per-node 2 examples/annotate_mlp.py  # real processes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import hp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import rel_err, tp_mesh  # noqa: E402  (the examples' shared helpers)


def mlp(x, w_in, w_out):
    return torch.nn.functional.gelu(x @ w_in) @ w_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, default=0, help="simulate this many tp ranks in one process")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    mesh, ranks = tp_mesh(args.simulate)

    torch.manual_seed(0)
    h, f = args.hidden, 4 * args.hidden
    x, w_in, w_out = torch.randn(args.batch, h), torch.randn(h, f) / h**0.5, torch.randn(f, h) / f**0.5

    ref = [w_in.clone().requires_grad_(), w_out.clone().requires_grad_()]
    ref_loss = mlp(x, *ref).square().mean()
    ref_loss.backward()

    with ranks:
        params = [
            hp.shard(w_in, "h f/tp", mesh).requires_grad_(),  # column parallel
            hp.shard(w_out, "f/tp h", mesh).requires_grad_(),  # row parallel
        ]
        y = mlp(hp.shard(x, "b h", mesh), *params)
        partial_layout = str(hp.layout_of(y))  # 'b h +tp': a pending sum
        loss = hp.constrain(y, "b h").square().mean()
        loss.backward()
        value = loss.detach().full_tensor().item()
        result = {
            "ranks": mesh.size(),
            "out_layout_before_constrain": partial_layout,
            "w_in": hp.describe(params[0]),
            "w_out": hp.describe(params[1]),
            "loss": value,
            "loss_rel_err": abs(value - ref_loss.item()) / abs(ref_loss.item()),
            "grad_rel_err": max(rel_err(p.grad.full_tensor(), r.grad) for p, r in zip(params, ref)),
        }
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

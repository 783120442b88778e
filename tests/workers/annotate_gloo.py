"""Worker for test_gloo.py: shard / constrain / from_local on a real 4-process gloo world.

Run by torchrun; every check raises on failure, so a non-zero exit is a failed test.
"""

from __future__ import annotations

import os
import sys

import torch

import hp
from hp.cost import ring_bytes


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from layout_strategies import expected_block

    mesh = hp.mesh(dp=2, tp=2)
    rank = torch.distributed.get_rank()
    assert torch.distributed.get_backend() == "gloo", torch.distributed.get_backend()
    torch.manual_seed(0)
    t = torch.randn(8, 12)

    def same_block(x, layout):
        want = expected_block(t, hp.layout(layout), mesh, rank)
        assert torch.equal(x.to_local(), want), f"rank {rank}: wrong block for {layout}"
        assert torch.equal(x.full_tensor(), t), f"rank {rank}: wrong values for {layout}"

    x = hp.shard(t, "b/dp h/tp", mesh)
    same_block(x, "b/dp h/tp")
    for target in ["b/tp h/dp", "b h/tp/dp", "b h/dp/tp", "b h +tp", "b/dp h +tp", "b h"]:
        y = hp.constrain(x, target)
        same_block(y, target)
        assert str(hp.layout_of(y)) == target

    # scatter from rank 0: the other ranks' copies must not matter
    mine = t if rank == 0 else torch.full_like(t, float(rank))
    same_block(hp.shard(mine, "b h/tp/dp", mesh, src=0), "b h/tp/dp")

    # from_local assembles each rank's own block
    z = hp.from_local(expected_block(t, hp.layout("b/tp h/dp"), mesh, rank), "b/tp h/dp", mesh)
    same_block(z, "b/tp h/dp")

    # hp.comm.trace() on a real gloo group: one all-reduce over tp with ring bytes
    partial = hp.shard(t, "b h +tp", mesh)
    with hp.comm.trace() as trace:
        same_block(hp.constrain(partial, "b h"), "b h")
    assert [(r.kind, r.axis) for r in trace.records] == [("all_reduce", "tp")], trace.table()
    assert trace.bytes() == ring_bytes("all_reduce", t.numel() * 4, 2)

    # gradients flow back through a strided reshard and a partial sum
    w = torch.randn(8, 12)
    ref = t.clone().requires_grad_()
    (ref.tanh() * w).sum().backward()
    leaf = hp.shard(t, "b/dp h/tp", mesh).requires_grad_()
    y = hp.constrain(hp.constrain(leaf, "b h/tp/dp"), "b h +dp")
    (y.tanh() * hp.shard(w, "b h", mesh)).sum().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad)

    check_fully_shard_composes(mesh, rank)
    check_2d_llama(rank)
    print(f"rank {rank} ok", flush=True)


def check_2d_llama(rank) -> None:
    """2D tensor parallelism on a 2x2 mesh: a tiny HF Llama matches the unsharded model."""
    from transformers import AutoModelForCausalLM

    from hp.parallel import tp_plan
    from hp.models import tiny_config
    from hp.models.llama import choice_layouts

    mesh = hp.mesh(x=2, y=2)
    plan, outputs = choice_layouts(tp_plan.Choice("2d", {"x": 2, "y": 2}, 0, 1))
    torch.manual_seed(0)
    reference, model = (AutoModelForCausalLM.from_config(tiny_config("llama", layers=1)) for _ in range(2))
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (4, 16))
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    hp.parallelize(model, mesh, plan, outputs=outputs)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss, msg=f"rank {rank}: 2D loss")
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"rank {rank}: 2D grad of {name}")


def check_fully_shard_composes(mesh, rank) -> None:
    """hp.parallelize over tp, then FSDP2 over dp: same loss and gradients as one device."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    make = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
    )
    reference, model = make(), make()
    model.load_state_dict(reference.state_dict())
    batch = torch.randn(8, 8)
    reference(batch).square().mean().backward()

    hp.parallelize(model, mesh["tp"], {"0.weight": "out/tp in", "0.bias": "out/tp", "2.weight": "out in/tp"})
    fully_shard(model, mesh=mesh["dp"])
    assert str(hp.layout_of(model[0].weight)) == "16/tp/dp 8", hp.layout_of(model[0].weight)
    local = batch.chunk(2)[mesh.get_coordinate()[0]]  # each dp rank its half of the batch
    model(local).square().mean().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"rank {rank}: grad of {name}")


if __name__ == "__main__":
    main()

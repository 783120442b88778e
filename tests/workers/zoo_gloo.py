"""Worker for test_gloo.py: the zoo's strategies on 4 real gloo processes.

The families whose layouts differ in what FSDP shards again under (dp=2
fsdp, tp=2): Llama (with activation recompute, which FSDP2 runs only here),
Qwen2 (tp-split biases), Phi-3 (fused q/k/v and gate/up split over tp) and
Gemma-3 (tied embedding, extra norms); Mistral, Qwen3 and Gemma-2 lay out as
one of those and are checked simulated, without FSDP, in test_zoo.py. Llama under (dp=2, tp=2), (cp=4) Ulysses, (cp=4)
ring, and FSDP over the context axis: (dp=2, cp=2 fsdp) Ulysses, sharded over
all 4 ranks, and (cp=2 fsdp, tp=2) ring with parameters kept gathered between
forward and backward, the last two under `hp.mpmd` (FSDP's gathers
prefetched, the tp linears pipelined from the third step on): loss and every
gradient equal the unsharded HF model, and 5 AdamW steps give its losses. Then FSDP's mixed precision: parameters
gathered in bf16, gradients reduced in fp32. Then Qwen3-MoE with expert
parallel under FSDP (dp=4 of which ep=2): the experts sharded again over the
two ranks that hold the same experts, everything else over all four, its
Switch auxiliary loss in the loss; and its weights saved by transformers (one
expert at a time) read back by `hp train`'s loader into those packed, sharded
blocks. And LoRA under (dp=2 fsdp, tp=2): only the adapters train, as in the
unsharded LoRA model. Where torch has `fully_shard(dp_mesh_dims=...)`, two of
those run again through `hp.compat.fsdp`, the path torch 2.11 takes. Every
check raises on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from transformers import AutoModelForCausalLM

import hp
from hp.ops.expert_parallel import expert_loads
from hp.parallel import plain_dp
from hp.models import FAMILIES, MOE_FAMILIES, plan_for, tiny_config


def tiny_pair(family: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(family, layers=1, **overrides)
    reference, model = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def labelled(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :2] = -100
    labels[0, 2:9] = -100  # unevenly over the batch: the loss must divide by the global count
    return labels


def down_proj(model) -> torch.Tensor:
    """The block's down projection as registered now (FSDP registers the sharded or the gathered one)."""
    return model.model.layers[0].mlp.down_proj.weight


def check(family: str, strategy: dict, rank: int, **overrides) -> None:
    reference, model = tiny_pair(family, **overrides)
    batches = [torch.randint(0, 256, (4, 16)) for _ in range(5)]
    mesh = hp.strategy_mesh(strategy)
    hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
    fsdp_axes = hp.Strategy.of(strategy).fsdp_axes
    if fsdp_axes and family in MOE_FAMILIES:  # experts: split over ep, then over the ranks holding the same ones
        layout = str(hp.layout_of(model.model.layers[0].mlp.experts.down_proj))
        assert layout == "8/ep 64/dp 32", f"rank {rank} {strategy}: experts {layout}"
        layout = str(hp.layout_of(model.model.layers[0].self_attn.o_proj.weight))
        assert layout == "64/dp_ep 64", f"rank {rank} {strategy}: attention {layout}"
    elif fsdp_axes:  # FSDP2 shards the blocks again over dp x cp, flattened: every rank holds a different shard
        tp = "/tp" if strategy.get("tp", 1) > 1 else ""
        layout = str(hp.layout_of(down_proj(model)))
        assert layout == f"64/{'_'.join(fsdp_axes)} 128{tp}", f"rank {rank} {strategy}: {layout}"
    mlp_calls = []  # the block's MLP runs once per step, twice with recompute (again in backward)
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: mlp_calls.append(1))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def forward_backward(ids, labels, where):
        got = model(input_ids=ids, labels=labels).loss
        if fsdp_axes and family not in MOE_FAMILIES:  # the block is still gathered after forward only when not resharded
            gathered = down_proj(model).to_local().shape[0] == 64
            assert gathered != strategy.get("reshard_after_forward", True), f"{where}: gathered {gathered}"
        got.backward()
        return got

    run = hp.mpmd(forward_backward, chunks=strategy["mpmd"]) if "mpmd" in strategy else forward_backward
    for step, ids in enumerate(batches):
        labels = labelled(ids)
        want = reference(input_ids=ids, labels=labels).loss
        want.backward()
        where = f"rank {rank} {family} {strategy} step {step}"
        got = run(ids, labels, where)
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=where)
        if step == 0:
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"{where}: {name}")
        runs = (2 if strategy.get("recompute") else 1) * (step + 1)
        assert len(mlp_calls) == runs, f"{where}: {len(mlp_calls)} MLP calls, expected {runs}"
        hp.reduce_gradients(model)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def check_plain_dp(family: str, rank: int, fsdp: bool = False, **overrides) -> None:
    """dp alone (or FSDP over dp): plain parameters gathered plain, each rank its rows (balanced by their padded
    tokens, cut after their last label), the head computed on supervised positions only, gradients summed during
    backward. Per step two micro-batches, the first held back from the sums (`accumulating`); the loss, every
    summed gradient and 3 AdamW steps equal the unsharded model's. A MoE's experts that a rank's rows leave unused
    add zeros."""
    reference, model = tiny_pair(family, **overrides)
    strategy = {"dp": 4, "recompute": True, "fsdp": fsdp}
    hp.apply_strategy(model, hp.strategy_mesh(strategy), strategy, plan_for(model.config))
    layouts = {(type(p).__name__, tuple(getattr(p, "placements", ()))) for p in model.parameters()}
    assert layouts == ({("DTensor", (Shard(0),))} if fsdp else {("Parameter", ())}), f"rank {rank}: {layouts}"
    for bad, message in ((lambda: model(input_ids=torch.zeros(3, 16, dtype=torch.long)),
                          "a batch of 3 rows does not split evenly over dp=4"),
                         (lambda: model(torch.zeros(4, 16, dtype=torch.long)), "takes the model's inputs by keyword")):
        try:
            bad()
        except (ValueError, TypeError) as refused:
            assert message in str(refused), f"rank {rank}: {refused}"
        else:
            raise AssertionError(f"rank {rank}: no error for {message!r}")
    heads = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: heads.append(args[0].shape[:-1]))
    ref_opt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        where = f"rank {rank} {family} plain dp{' fsdp' if fsdp else ''} step {step}"
        for micro in range(2):
            draw = torch.Generator().manual_seed(2 * step + micro)  # the same global batch on every rank
            ids = torch.randint(0, 256, (8, 16), generator=draw)
            labels = labelled(ids)
            for row, end in enumerate(torch.randint(3, 17, (8,), generator=draw).tolist()):  # rows of their lengths
                labels[row, end:] = -100
            want = reference(input_ids=ids, labels=labels).loss
            (want / 2).backward()
            with plain_dp.accumulating(model) if micro == 0 else contextlib.nullcontext():
                got = model(input_ids=ids, labels=labels).loss
                (got / 2).backward()
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=lambda m: f"{where}: {m}")
        hp.reduce_gradients(model)
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if fsdp else p.grad
            torch.testing.assert_close(grad, r.grad if r.grad is not None else torch.zeros_like(grad),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"{where}: {name}: {m}")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert all(len(shape) == 1 for shape in heads), f"rank {rank}: the head saw {heads[:2]}, not supervised rows"
    loads = torch.cat(expert_loads(model)) if plan_for(model.config).experts else torch.zeros(1)
    every = [torch.zeros_like(loads) for _ in range(dist.get_world_size())]
    dist.all_gather(every, loads)
    assert all(torch.equal(other, loads) for other in every), f"rank {rank}: expert loads differ over dp"


def check_lora(rank: int) -> None:
    """LoRA under FSDP and tp: the adapters' gradients and 5 AdamW steps of them equal the unsharded LoRA model's."""
    reference, model = tiny_pair("llama")
    for m in (reference, model):
        hp.add_lora(m, hp.Lora(rank=4, alpha=8))
    torch.manual_seed(1)
    for name, p in reference.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.05)  # B at random: A's gradients are not zero
    model.load_state_dict(reference.state_dict())
    strategy = {"dp": 2, "tp": 2, "fsdp": True}
    hp.apply_strategy(model, hp.strategy_mesh(strategy), strategy, plan_for(model.config))
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref_opt, opt = torch.optim.AdamW(trained(reference), lr=1e-2), torch.optim.AdamW(trained(model), lr=1e-2)
    for step in range(5):
        ids = torch.randint(0, 256, (4, 16))
        want = reference(input_ids=ids, labels=labelled(ids)).loss
        got = model(input_ids=ids, labels=labelled(ids)).loss
        want.backward()
        got.backward()
        where = f"rank {rank} lora {strategy} step {step}"
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=0, msg=where)
        hp.reduce_gradients(model)
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (r.grad is None) == (not p.requires_grad), f"{where}: {name}"
            if step == 0 and p.grad is not None:
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=f"{where}: {name}")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def check_mixed_precision(rank: int) -> None:
    """bf16 gathered and computed in, fp32 reduced in and kept: the loss within bf16's error of HF's fp32 one."""
    strategy = {"cp": 4, "fsdp": True, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    reference, model = tiny_pair("llama")
    ids = torch.randint(0, 256, (4, 16))
    want = reference(input_ids=ids, labels=labelled(ids)).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy)
    hp.apply_strategy(model, mesh, strategy, plan_for(model.config))
    gathered = []  # runs after FSDP's own pre-forward hook, which gathers the block
    model.model.layers[0].register_forward_pre_hook(lambda block, args: gathered.append(down_proj(model).dtype))
    # FSDP2's reduce-scatter: `reduce_scatter_single` where torch has it, `reduce_scatter_tensor` before
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    with mock.patch.object(dist, scatter, wraps=getattr(dist, scatter)) as reduce_scatter:
        got = model(input_ids=ids, labels=labelled(ids)).loss
        got.backward()
    where = f"rank {rank} {strategy}"
    assert gathered == [torch.bfloat16], f"{where}: gathered {gathered}"
    reduced = {call.kwargs["input"].dtype for call in reduce_scatter.call_args_list}
    assert reduced == {torch.float32}, f"{where}: reduce-scattered {reduced}"
    kept = {(p.dtype, p.grad.dtype) for p in model.parameters()}
    assert kept == {(torch.float32, torch.float32)}, f"{where}: sharded parameters and gradients {kept}"
    torch.testing.assert_close(got.full_tensor(), want, rtol=2e-2, atol=0, msg=where)  # bf16 keeps 8 bits
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        error = float((p.grad.full_tensor() - r.grad).norm() / r.grad.norm())
        assert error < 3e-2, f"{where}: {name} gradient off by {error:.3f} of its norm"


def check_expert_loading(rank: int) -> None:
    """HF's per-expert files, read rank by rank into experts split over ep and sharded by FSDP, equal the model."""
    from hp.train.model import build_model

    reference, _ = tiny_pair("qwen3_moe")
    directory = os.path.join(tempfile.gettempdir(), f"hp-moe-weights-{os.environ['MASTER_PORT']}")
    strategy = hp.Strategy(dp=4, ep=2, fsdp=True)
    mesh = hp.strategy_mesh(strategy)
    if rank == 0:
        reference.save_pretrained(directory)
    dist.barrier()
    model = build_model(directory, reference.config.vocab_size, mesh, strategy, seed=1)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.full_tensor(), r.detach()), f"rank {rank}: {name} read back wrong"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory)


FSDP_FAMILIES = ("llama", "qwen2", "phi3", "gemma3_text")
assert set(FSDP_FAMILIES) <= set(FAMILIES)


def main() -> None:
    rank = int(os.environ["RANK"])
    for family in FSDP_FAMILIES:
        check(family, {"dp": 2, "tp": 2, "fsdp": True, "recompute": family == "llama"}, rank)
    for strategy in (
        {"dp": 2, "tp": 2}, {"cp": 4}, {"cp": 4, "cp_algorithm": "ring"}, {"dp": 2, "cp": 2, "fsdp": True, "mpmd": 2},
        {"cp": 2, "tp": 2, "cp_algorithm": "ring", "fsdp": True, "reshard_after_forward": False, "mpmd": 2},
    ):  # under hp.mpmd from step 3 on: FSDP's prefetched gathers, pipelined tp linears
        check("llama", strategy, rank)
    check_plain_dp("llama", rank)
    check_plain_dp("llama", rank, fsdp=True)
    check_plain_dp("qwen3_moe", rank)
    check_lora(rank)
    check_mixed_precision(rank)
    check("qwen3_moe", {"dp": 4, "ep": 2, "fsdp": True}, rank, output_router_logits=True, router_aux_loss_coef=0.1)
    check_expert_loading(rank)
    if hp.compat.backports.fsdp_on_the_whole_mesh():  # the steps torch 2.11 runs, here against dp_mesh_dims' results
        with mock.patch.object(hp.compat.backports, "fsdp_on_the_whole_mesh", lambda: False):
            check("phi3", {"dp": 2, "tp": 2, "fsdp": True}, rank)  # fused parts split over tp, then dp
            # experts over dp on the ep mesh; the rest over all four, no axis left: plain tensors for FSDP
            check("qwen3_moe", {"dp": 4, "ep": 2, "fsdp": True}, rank, output_router_logits=True,
                  router_aux_loss_coef=0.1)
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()

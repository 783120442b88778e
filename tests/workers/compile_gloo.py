"""Worker for test_gloo.py: hp-laid-out Llama blocks under `torch.compile(fullgraph=True)` on real gloo ranks.

On 2 ranks, each strategy's compiled model against HF's unsharded one: the loss and every
gradient of 3 AdamW steps (fp32, relative 1e-5), no graph compiled after the first step and
no graph break. tp+sp goes through `hp.Strategy(compile=True)` with inductor's generated
kernels; the other strategies through `hp.compile_blocks(..., backend="aot_eager")`, which
traces forward and backward the same way (dynamo, AOTAutograd, DTensor's subclass
desugaring) and runs the traced graphs eagerly, so compiling costs seconds. On 4 ranks, the
2D and SUMMA layouts of `hp.tp_plan` the same way. Every check raises on failure.
"""

from __future__ import annotations

import os

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

import hp
from hp import tp_plan
from hp.models import plan_for, tiny_config
from hp.models.llama import choice_layouts

STRATEGIES_2 = [({"tp": 2, "sp": True, "compile": True}, None), ({"tp": 2}, "aot_eager"),
                ({"cp": 2, "cp_algorithm": "ring"}, "aot_eager"), ({"cp": 2}, "aot_eager"),
                ({"dp": 2, "fsdp": True}, "aot_eager")]
SCHEMES_4 = ["2d", "summa"]


def pair():
    torch.manual_seed(0)
    config = tiny_config("llama", layers=2)
    reference, model = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    return reference, model


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def follows(reference, model, where: str, batch: int = 4) -> None:
    """3 AdamW steps of `model` give `reference`'s losses and gradients; nothing compiles after the first."""
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ids = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(step))
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        got = model(input_ids=ids, labels=ids).loss
        got.backward()
        rel = abs(whole(got).item() - want.item()) / want.item()
        assert rel < 1e-5, f"{where} step {step}: loss {whole(got).item()} vs {want.item()} ({rel:.1e})"
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            g = whole(p.grad)
            err = ((g - r.grad).norm() / r.grad.norm()).item()
            assert err < 1e-5, f"{where} step {step}: gradient of {name} off by {err:.1e}"
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, f"{where}: recompiled after the first step"
    assert not counters["graph_break"], f"{where}: graph breaks {dict(counters['graph_break'])}"


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    if world == 2:
        for strategy, backend in STRATEGIES_2:
            reference, model = pair()
            hp.apply_strategy(model, hp.strategy_mesh(strategy), strategy, plan_for(model.config))
            if backend is not None:
                hp.compile_blocks(model.model.layers, backend=backend)
            follows(reference, model, f"{strategy} ({backend or 'inductor'})")
    else:
        axes = {"x": 2, "y": 2}
        mesh = hp.mesh(list(axes.items()))
        for scheme in SCHEMES_4:
            plan, outputs = choice_layouts(tp_plan.Choice(scheme, axes, 0, 1))
            reference, model = pair()
            hp.parallelize(model, mesh, plan, outputs=outputs)
            hp.compile_blocks(model.model.layers, backend="aot_eager")
            follows(reference, model, f"{scheme} {axes}", batch=8)
    print(f"rank {os.environ['RANK']}: compiled blocks follow the reference", flush=True)


if __name__ == "__main__":
    main()

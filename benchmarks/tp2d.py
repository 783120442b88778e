"""Tensor-parallel communication, 1D vs 2D vs token-sharded 3D: formula and measurement.

For T tokens and Llama-3-8B shapes (h=4096, 32 heads, 8 KV heads, SwiGLU
ffn=14336) and each block (`square` = h->h->h, `mlp`, `layer` = GQA
attention projections + MLP; attention itself is local), this runs forward
and backward with hp's kernels on a simulated mesh of p ranks (fake process
group, fake tensors: no data, exact shapes), counts the bytes each rank sends
with `hp.comm.trace()`, and compares them with `hp.tp_plan`'s formulas.
One JSON line per (block, p); then the 2D activation memory of the MLP; then a
whole small HF Llama run at each p with real values on simulated ranks (the
planner's choice, per-layer bytes against the formula); then `hp train`'s
first step under `parallel.tp2d` (2 x 2), simulated and for real on 4 gloo
processes, against `hp.tp_plan.step_bytes_2d`; the last line is a
summary whose `targets_met` says whether 2D saves what it should over 1D (at
least 42% of the bytes for the square block at p=8, 31% and 60% for a layer
at p=16 and p=64). Runs in about half a minute on a CPU.

    python benchmarks/tp2d.py [--tokens 8192] [--plot benchmarks/tp2d.png]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

import hp
from hp.parallel import tp_plan
from hp.models.llama import choice_layouts
from hp.plot import pyplot

H, HEADS, KV_HEADS, FFN = 4096, 32, 8, 14336
BLOCKS = {
    "square": tp_plan.square(H),
    "mlp": tp_plan.mlp(H, FFN),
    "layer": tp_plan.layer(H, HEADS, KV_HEADS, FFN),
}


def local_op(block: tp_plan.Block, outs: list[DTensor]) -> DTensor:
    """The block's rank-local middle: attention stand-in, SwiGLU, or an activation."""
    if block.name == "mlp":
        return F.silu(outs[0]) * outs[1]
    if block.name == "square":
        return F.gelu(outs[0])
    q, k, v = outs  # heads split alike over the same axis: a rank's q heads meet its kv heads
    group = q.to_local().shape[-1] // k.to_local().shape[-1]
    mixed = q.to_local() * k.to_local().repeat_interleave(group, -1) + v.to_local().repeat_interleave(group, -1)
    return DTensor.from_local(mixed, q.device_mesh, q.placements, shape=q.shape, stride=q.stride())


def layouts(scheme: str) -> tuple[str, str, str]:
    """(residual stream, group weights (out, in), closing weight (out, in))."""
    if scheme == "1d":
        return "t h", "o/tp i", "o i/tp"
    if scheme == "summa":
        return "t/x h/y", "o/y i/x", "o/y i/x"
    tokens = "t/z/y" if scheme == "3d" else "t/y"
    return f"{tokens} h/x", "o/y i/x", "o/x i/y"


def measure(blocks: list[tp_plan.Block], scheme: str, mesh_axes: dict[str, int], tokens: int) -> int:
    """Bytes per rank of forward + backward, with gradients delivered in their layouts."""
    mesh = hp.mesh(list(mesh_axes.items()), simulate=True)
    residual, group_w, close_w = layouts(scheme)
    with FakeTensorMode(), hp.region():
        x = hp.shard(torch.empty(tokens, H), residual, mesh).requires_grad_()  # the block's input
        params = []
        for b in blocks:
            ws = [hp.shard(torch.empty(f, b.h), group_w, mesh).requires_grad_() for f in b.fan_out]
            params += [(w, group_w) for w in ws] + [(hp.shard(torch.empty(b.h, b.mid), close_w, mesh).requires_grad_(), close_w)]
        with hp.comm.trace() as trace:
            h, at = x, 0
            for b in blocks:
                ws = [w for w, _ in params[at : at + len(b.fan_out) + 1]]
                at += len(ws)
                y = F.linear(local_op(b, [F.linear(h, w) for w in ws[:-1]]), ws[-1])
                h = h + hp.constrain(y, residual)  # 1D: the all-reduce; 2D/3D: already in place
            h.sum().backward()
            hp.constrain(x.grad, residual)
            for w, layout in params:
                hp.constrain(w.grad, layout)  # 3D: the weight-gradient all-reduce over z
    return trace.bytes()


def saved_activation_bytes(fn, weight_shapes: set) -> int:
    """Bytes of the tensors autograd saves for backward in `fn`, weights (by shape) excluded."""
    total = 0

    def pack(t):
        nonlocal total
        local = t.to_local() if isinstance(t, DTensor) else t
        if tuple(local.shape) not in weight_shapes:
            total += local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def mlp_activation_memory(tokens: int, x: int, y: int) -> dict:
    """Activation bytes one rank saves in the MLP, 2D on x*y vs one device, measured and predicted.

    Inputs of the linears are saved gathered (so backward needs no extra gather): the MLP input
    at 1/x of its size (once per reading linear), the down projection's input at 1/y; the
    elementwise intermediates at 1/(x*y).
    """
    h, ffn, e = H, FFN, 4
    t = tokens
    mesh = hp.mesh(x=x, y=y, simulate=True)
    shapes = {(ffn, h), (h, ffn), (ffn // y, h // x), (h // x, ffn // y)}
    with FakeTensorMode():
        inp, wg, wu, wd = (torch.empty(s, requires_grad=True) for s in ((t, h), (ffn, h), (ffn, h), (h, ffn)))
        one = saved_activation_bytes(lambda: F.linear(F.silu(F.linear(inp, wg)) * F.linear(inp, wu), wd), shapes)
        with hp.region():
            xs = [hp.shard(torch.empty(t, h), "t/y h/x", mesh).requires_grad_()]
            xs += [hp.shard(torch.empty(ffn, h), "o/y i/x", mesh).requires_grad_() for _ in range(2)]
            xs += [hp.shard(torch.empty(h, ffn), "o/x i/y", mesh).requires_grad_()]
            two = saved_activation_bytes(
                lambda: F.linear(F.silu(F.linear(xs[0], xs[1])) * F.linear(xs[0], xs[2]), xs[3]), shapes
            )
    predicted = e * (2 * t * h // x + 3 * (t // x) * (ffn // y) + t * ffn // y)
    return {
        "memory": "mlp", "mesh": f"{x}x{y}", "act_bytes_1dev": one, "act_bytes_2d": two,
        "ratio": round(two / one, 4), "one_over_p": round(1 / (x * y), 4), "formula_match": two == predicted,
    }


def llama_at_scale(p: int, batch: int = 64, seq: int = 16) -> dict:
    """A whole (small) HF Llama on p simulated ranks with real values: the planner's choice runs.

    Per decoder layer, the forward bytes measured equal the projections' formula plus the
    RMSNorm statistics (two all-reduces of one number per local token over the axis that
    splits the hidden dim).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    h, heads, ffn, tokens = 256, 16, 512, batch * seq
    config = LlamaConfig(
        vocab_size=512, hidden_size=h, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, use_cache=False,
    )
    blocks = tp_plan.layer(h, heads, heads, ffn)
    choice = tp_plan.choose(blocks, tokens, p, schemes=("1d", "2d", "summa"))
    mesh = hp.mesh(list(choice.mesh.items()), simulate=True)
    plan, outputs = choice_layouts(choice)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with hp.simulated(mesh):
        hp.parallelize(model, mesh, plan, outputs=outputs)
        layers = hp.comm.trace_each(model.model.layers)
        with hp.comm.trace() as step:
            model(input_ids=ids, labels=ids).loss.backward()
    measured = [t.bytes(phase="forward") for t in layers]
    # forward is half of each scheme's step: backward mirrors it byte for byte
    if choice.scheme == "1d":
        formula, norms = tp_plan.bytes_1d(blocks, tokens, p).total // 2, 0
    else:
        x, y = choice.mesh["x"], choice.mesh["y"]
        if choice.scheme == "summa":  # residual t/x h/y: norm statistics all-reduced over y
            formula = tp_plan.bytes_summa(blocks, tokens, x, y).total // 2
            norms = 2 * (2 * (y - 1) * (tokens // x) * 4 // y)
        else:  # residual t/y h/x: over x
            formula = tp_plan.bytes_2d(blocks, tokens, x, y).total // 2
            norms = 2 * (2 * (x - 1) * (tokens // y) * 4 // x)
    return {
        "llama_at_scale": p, "choice": choice.scheme + " " + " ".join(f"{k}={v}" for k, v in choice.mesh.items()),
        "layer_fwd_bytes": measured, "layer_fwd_formula": formula + norms, "norm_stats_bytes": norms,
        "step_bytes": step.bytes(), "formula_match": all(m == formula + norms for m in measured),
    }


SCALAR = 256  # payload bytes at most: a collective of scalars (the loss's sum, the gradient norm's parts)
TRAIN = ["examples/quickstart.yaml", "parallel.tp=1", "parallel.tp2d={x: 2, y: 2}", "dataset_dir=examples/data"]


def train_step(real: bool = True) -> dict:
    """`hp train`'s first step under tp2d (2d on x=2, y=2: the quickstart's tiny Llama and first batch).

    The step (forward, backward, gradient sums, clipping) runs on 4 simulated ranks with hp train's own
    model building and clipping; the bytes of its tensor collectives, per mesh axis, equal
    `hp.tp_plan.step_bytes_2d`. With `real`, `hp train` itself then runs one step on 4 gloo processes,
    and the bytes it reports per axis (`comm_bytes_per_step`, scalars included) equal the simulated step's.
    """
    from hp.train.config import load_config
    from hp.train.data import TokenBatches, load_examples, load_tokenizer
    from hp.train.clipping import clip_gradients
    from hp.train.model import build_model
    from hp.parallel.tp2d import layer_blocks

    config = load_config(TRAIN[0], TRAIN[1:])
    tokenizer = load_tokenizer(config.model_name_or_path)
    batch = next(TokenBatches(load_examples(config, tokenizer), config.per_device_train_batch_size, config.seed,
                              tokenizer.pad_token_id))
    strategy = config.parallel
    mesh = hp.strategy_mesh(strategy, simulate=True)
    with hp.simulated(mesh):
        model = build_model(config.model_name_or_path, tokenizer.vocab_size, mesh, strategy, seed=config.seed)
        with hp.comm.trace() as trace:
            loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
            loss.backward()
            loss.full_tensor()
            hp.reduce_gradients(model)
            clip_gradients(model.parameters(), config.max_grad_norm)
    measured, scalars = {}, {}
    for r in trace.records:
        into = scalars if r.payload_bytes <= SCALAR else measured
        into[r.axis] = into.get(r.axis, 0) + r.bytes
    c = model.config
    decoder = tp_plan.Decoder(tuple(layer_blocks(c)), c.num_hidden_layers, c.vocab_size)
    formula = {}
    for (_, axis), n in tp_plan.step_bytes_2d(decoder, batch.input_ids.numel(), 2, 2).by.items():
        formula[axis] = formula.get(axis, 0) + n
    line = {"train_step": "tp2d 2d x=2 y=2", "tokens": batch.input_ids.numel(), "bytes_per_step": measured,
            "formula": formula, "scalar_bytes": scalars, "formula_match": measured == formula}
    if real:
        simulated = {a: measured.get(a, 0) + scalars.get(a, 0) for a in {*measured, *scalars}}
        line["hp_train_comm_bytes_per_step"] = _hp_train_bytes()
        line["hp_train_matches_simulated"] = line["hp_train_comm_bytes_per_step"] == simulated
    return line


def _hp_train_bytes() -> dict:
    """`hp train TRAIN max_steps=1`'s reported bytes per step per axis (4 gloo workers)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-m", "hp.cli", "train", *TRAIN, "max_steps=1", "save_steps=10",
                              f"output_dir={out}"], capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"hp train failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])["comm_bytes_per_step"]


def best(blocks, tokens: int, p: int, scheme: str) -> tuple[dict[str, int], int] | None:
    """(mesh, formula bytes) of the cheapest factorisation of `scheme`, or None."""
    parts = {"2d": 2, "summa": 2, "3d": 3}[scheme]
    options = []
    for dims in tp_plan.factorisations(p, parts):
        axes = dict(zip(("z", "x", "y")[3 - parts :], dims))
        if scheme == "summa":
            cost = tp_plan.bytes_summa(blocks, tokens, axes["x"], axes["y"]).total
        else:
            cost = tp_plan.bytes_2d(blocks, tokens, axes["x"], axes["y"], axes.get("z", 1)).total
        options.append((cost, axes))
    if not options:
        return None
    cost, axes = min(options, key=lambda o: o[0])
    return axes, cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--plot", default="benchmarks/tp2d.png", help="PNG path (needs the plot extra)")
    parser.add_argument("--no-hp-train", action="store_true", help="skip the real 4-process hp train step")
    args = parser.parse_args()

    rows = []
    for name, blocks in BLOCKS.items():
        for p in args.ranks:
            one = tp_plan.bytes_1d(blocks, args.tokens, p).total
            row = {"block": name, "p": p, "bytes_1d": one}
            match = measure(blocks, "1d", {"tp": p}, args.tokens) == one
            for scheme, suffix in (("2d", ""), ("summa", "_summa"), ("3d", "_3d")):
                found = best(blocks, args.tokens, p, scheme)
                if found is None:
                    continue
                axes, cost = found
                row[f"mesh{suffix}"] = "x".join(str(n) for n in axes.values())
                row[f"bytes{suffix or '_2d'}"] = cost
                row[f"reduction{suffix}"] = round(1 - cost / one, 4)
                match = match and measure(blocks, scheme, axes, args.tokens) == cost
            choice = tp_plan.choose(blocks, args.tokens, p)
            row["planner"] = choice.scheme + " " + " ".join(f"{k}={v}" for k, v in choice.mesh.items())
            row["planner_bytes"] = choice.bytes
            row["formula_match"] = match
            rows.append(row)
            print(json.dumps(row), flush=True)

    memory = [mlp_activation_memory(args.tokens, x, y) for x, y in ((2, 2), (2, 4), (4, 2), (4, 4))]
    for line in memory:
        print(json.dumps(line), flush=True)

    at_scale = [llama_at_scale(p) for p in args.ranks]
    for line in at_scale:
        print(json.dumps(line), flush=True)

    train = train_step(real=not args.no_hp_train)
    print(json.dumps(train), flush=True)

    def get(block, p, key):
        return next(r[key] for r in rows if r["block"] == block and r["p"] == p)

    summary = {
        "summary": True,
        "layer_p16_reduction_summa": get("layer", 16, "reduction_summa"),
        "layer_p64_reduction_summa": get("layer", 64, "reduction_summa"),
        "tokens": args.tokens,
        "square_p8_reduction": get("square", 8, "reduction"),
        "layer_p16_reduction": get("layer", 16, "reduction"),
        "layer_p64_reduction": get("layer", 64, "reduction"),
        "layer_p16_reduction_3d": get("layer", 16, "reduction_3d"),
        "layer_p64_reduction_3d": get("layer", 64, "reduction_3d"),
        "formula_match": all(r["formula_match"] for r in rows + memory + at_scale),
        "mlp_act_mem_ratio_4x4": memory[-1]["ratio"],
        "planner_never_above_1d": all(r["planner_bytes"] <= r["bytes_1d"] for r in rows),
        "hp_train_bytes_match_formula": train["formula_match"] and train.get("hp_train_matches_simulated", True),
    }
    summary["targets_met"] = (
        summary["square_p8_reduction"] >= 0.42
        and summary["layer_p16_reduction"] >= 0.31
        and summary["layer_p64_reduction"] >= 0.60
    )
    _plot(rows, args.plot)
    print(json.dumps(summary))


def _plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for block in BLOCKS:
        mine = [r for r in rows if r["block"] == block]
        ax.plot([r["p"] for r in mine], [r["reduction"] for r in mine], marker="o", label=f"{block} 2D")
        three = [r for r in mine if "reduction_3d" in r]
        ax.plot([r["p"] for r in three], [r["reduction_3d"] for r in three], marker="s", linestyle="--", label=f"{block} 3D")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor-parallel ranks p")
    ax.set_ylabel("bytes saved vs 1D (fwd + bwd, per rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

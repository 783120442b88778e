"""The model zoo under every strategy: numbers equal to HF's, communication equal to Megatron's.

For each family `hp.models` has a plan for (every transformers causal LM
with a tensor- or pipeline-parallel plan, its plan derived from transformers' own, and the
hand-planned vision-language families; tiny configs built in code by
`hp.models.tiny.sizes_for`: hidden 64, 8 query heads of dim 8, 2 layers,
batch 4 x 16 tokens, fp32) and each strategy (tp, tp+sp, dp+tp, cp with
Ulysses and with ring, cp+tp; ep and ep+tp for the mixture-of-experts
families; the vision-language families, with images in their batch, also tp
with the vision tower split over tp), one forward and backward on simulated
ranks (one process, real values), against the unsharded HF model. Each line:

- `loss_rel`, `grad_rel`: relative error of the loss and the worst gradient;
  `grad_rel` leaves out a gradient that fp32 itself cannot give to 1e-5 (a
  small sum that cancels: xIELU's `alpha_n`, Doge's `A`, whose HF fp32
  values sit 1e-5 to 3e-5 from the same model run in float64): one that
  misses HF's by 1e-5 but is within 1e-5 of float64, or within twice HF's
  own fp32 distance from it, is listed in `fp32_limited` instead;
- `fwd_collectives_per_layer`: the collectives of the last decoder layer's
  forward (`kind@axis`), from `hp.comm.trace`;
- `bytes_vs_megatron`: a layer's forward tp bytes per rank over Megatron's (two
  ring all-reduces of the layer's activations, and one of a sum of squares per
  token for each norm over split features, as OLMo-2's full-width q/k norms);
  null without tp;
- `cp_bytes_vs_formula`: the same for the cp axis against Ulysses' four
  all-to-alls or ring's cp-1 K/V blocks; null without cp;
- `a2a_bytes_vs_formula` (under ep): the ep collectives of the last layer's
  forward on rank 0 over what its routing says they must move: the expert
  counts for the other ranks (int64), the (token, k) rows routed to another
  rank's experts, and the rows other ranks routed to its experts, sent back
  (each a hidden vector, fp32). The routing is the experts' `top_k_index` as
  the laid-out model's router gave it (tied scores, as a fresh AFMoE router's,
  may break otherwise than in HF's model; the loss matches either way), so
  the bytes are checked against the rows the routing needs; null without ep;
- `vision_fwd_collectives` (vision-language families): the vision tower's
  forward collectives, all its blocks (none when it is replicated over the
  decoder's ranks).

Two more lines show what the plans buy (`"plan": "naive"`, not counted in the
summary): Phi-3 laid out with plain `out/tp` on its fused weights, and Gemma-2
without the residual-stream outputs of its plan. The last line: `families`
(how many ran), `derived` (how many of them by a plan derived from
transformers' own), `all_match`, `megatron_bytes` (over the dense families,
tp bytes no more than Megatron's and cp bytes the algorithm's;
an MoE layer's experts do not cross tp), `a2a_bytes_match` (every ep run's
`a2a_bytes_vs_formula` is 1), `mismatched` (the families with a miss or an error), and
`refused`: each family left out, with its reason (a layer hp cannot split
yet, or a tiny config its own class rejects). A gradient that is zero in
exact arithmetic (DeepSeek-V4's hash-routed gate at a fresh, all-zero
routing table) is compared against a floor of 1e-6 rather than its own noise.

    python benchmarks/zoo.py > zoo.jsonl                 # about 15 minutes on 2 cores
    python benchmarks/zoo.py --table zoo.jsonl           # the families x strategies table of docs/benchmarks.md
    python benchmarks/zoo.py --families=llama,olmo2      # some families only
"""

from __future__ import annotations

import copy
import fnmatch
import json
import sys
import time

import torch
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import hp
from hp.cost import ring_bytes
from hp.parallel.model_plan import ModelPlan
from hp.models import VL_FAMILIES, plan_for, supported, tiny_config, tiny_vl_batch

BATCH, SEQ, HEAD_DIM, TOLERANCE = 4, 16, 8, 1e-5
STRATEGIES = [
    {"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2}, {"cp": 2}, {"cp": 2, "cp_algorithm": "ring"},
    {"cp": 2, "tp": 2},
]
VL_STRATEGIES = [*STRATEGIES, {"tp": 2, "vision_tp": True}]  # and the vision tower split over tp too
MOE_STRATEGIES = [*STRATEGIES, {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-6))


def measure(family: str, strategy: hp.Strategy, plan: ModelPlan | None = None) -> dict:
    """One step of `family` under `strategy` against HF's unsharded model."""
    torch.manual_seed(0)
    config = tiny_config(family, layers=2)
    auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
    reference, model = auto.from_config(config), auto.from_config(config)
    model.load_state_dict(reference.state_dict())
    inputs = tiny_vl_batch(reference, seq=SEQ) if family in VL_FAMILIES else _text(config)
    naive, plan = plan is not None, plan or plan_for(config)
    exact = _float64_grads(reference, inputs)
    want = reference(**inputs).loss
    want.backward()
    mesh = hp.strategy_mesh(strategy, simulate=True)
    start = time.perf_counter()
    with hp.simulated(mesh):
        hp.apply_strategy(model, mesh, strategy, plan)
        norms = _split_norms(model, plan)
        routing = _routing(model, plan) if strategy.ep > 1 else None
        layers = hp.comm.trace_each(model.get_submodule(plan.blocks))
        vision = hp.comm.trace_each([model.get_submodule(plan.vision)]) if plan.vision else None
        loss = model(**inputs).loss
        loss.backward()
        loss_rel = abs(loss.full_tensor().item() - want.item()) / want.item()
        grads = {n: (p.grad.full_tensor(), r.grad) for (n, p), r in zip(model.named_parameters(), reference.parameters())
                 if r.grad is not None}  # a parameter the batch never reaches (an unrouted layer's) has none
        grad_rel, limited = _grad_errors(grads, exact)
        expert_ids = [_whole(ids) for ids in routing or ()]  # one per call of the experts
    forward = layers[-1].select(phase="forward")  # a layer inside the stack (a VL model's first gets whole tokens)
    tp_bytes = sum(r.bytes for r in forward if r.axis == "tp")
    cp_bytes = sum(r.bytes for r in forward if r.axis == "cp")
    ep_bytes = sum(r.bytes for r in forward if r.axis == "ep")  # a one-peer exchange is traced as send_recv
    tp_formula, cp_formula = formulas(strategy, config.get_text_config(), len(norms))
    extra = {"vision_fwd_collectives": [f"{r.kind}@{r.axis}" for r in vision[0].select(phase="forward")]} if vision else {}
    return {
        "family": family, "strategy": {k: v for k, v in strategy.as_dict().items() if v != getattr(hp.Strategy(), k)},
        "plan": "naive" if naive else "zoo",
        "loss_rel": loss_rel, "grad_rel": grad_rel, "fp32_limited": limited,
        "fwd_collectives_per_layer": [f"{r.kind}@{r.axis}" for r in forward],
        "bytes_vs_megatron": round(tp_bytes / tp_formula, 4) if tp_formula else None,
        "cp_bytes_vs_formula": round(cp_bytes / cp_formula, 4) if cp_formula else None,
        "a2a_bytes_vs_formula": round(ep_bytes / sum(a2a_formula(strategy, config, ids) for ids in expert_ids), 4)
                                 if expert_ids else None,
        **extra,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _float64_grads(reference: torch.nn.Module, inputs: dict) -> dict[str, torch.Tensor]:
    """The reference's gradients computed in float64, by name; empty where the family does not run in float64."""
    exact = copy.deepcopy(reference).double()
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")  # torch._grouped_mm takes no float64
    wide = {k: v.double() if torch.is_floating_point(v) else v for k, v in inputs.items()}
    try:
        exact(**wide).loss.backward()
    except (RuntimeError, TypeError):
        return {}
    return {n: p.grad for n, p in exact.named_parameters() if p.grad is not None}


def _grad_errors(grads: dict, exact: dict) -> tuple[float, list[str]]:
    """(the worst relative error against HF's fp32 gradients, the gradients fp32 cannot give to TOLERANCE).

    A gradient that misses HF's by TOLERANCE is compared with float64 instead: when it is within
    TOLERANCE of float64, or within twice HF's own fp32 distance from it (the two fp32 roundings
    add up), it is listed, not counted; otherwise it counts in full.
    """
    worst, limited = 0.0, []
    for name, (got, want) in grads.items():
        err = rel_err(got, want)
        if err >= TOLERANCE and name in exact:
            noise = rel_err(want.double(), exact[name])
            if rel_err(got.double(), exact[name]) <= max(TOLERANCE, 2 * noise):
                limited.append(name)
                continue
        worst = max(worst, err)
    return worst, limited


def _text(config) -> dict:
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def formulas(strategy: hp.Strategy, config, norms: int = 0) -> tuple[int, int]:
    """(Megatron's tp bytes, the CP algorithm's bytes) per layer forward per rank; 0 where the axis is absent.

    Megatron's are two all-reduces of the layer's activations, and for each of the layer's `norms`
    over split features (OLMo-2's full-width q/k norms) an all-reduce of a statistic per token
    (its sum of squares), never the features.
    """
    tokens = BATCH * SEQ // (strategy.dp * strategy.cp)
    tp, cp = strategy.tp, strategy.cp
    megatron = 0
    if tp > 1:
        megatron = 2 * ring_bytes("all_reduce", tokens * config.hidden_size * 4, tp)
        megatron += norms * ring_bytes("all_reduce", tokens * 4, tp)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    qk, v = _head_dims(config)
    if cp == 1:
        return megatron, 0
    if strategy.ring:
        return megatron, (cp - 1) * tokens * kv_heads // tp * (qk + v) * 4
    ulysses = sum(ring_bytes("all_to_all", tokens * n // tp * d * 4, cp)
                  for n, d in ((heads, qk), (kv_heads, qk), (kv_heads, v), (heads, v)))
    return megatron, ulysses


def _head_dims(config) -> tuple[int, int]:
    """(query and key, value) head dims: latent attention's keys carry the rope slice, its values not."""
    if getattr(config, "kv_lora_rank", None):
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return HEAD_DIM, HEAD_DIM


def _split_norms(model: torch.nn.Module, plan: ModelPlan) -> set[str]:
    """Filled by the forward: the norms of the laid-out model's last layer whose features arrive split
    over tp (OLMo-2's full-width q/k norms after split projections, Dory's sub-norms). Each costs one
    all-reduce of a statistic per token in Megatron's accounting; a replicated or per-head norm none."""
    layer, split = model.get_submodule(plan.blocks)[-1], set()

    def record(name, args):
        x = args[0]
        if isinstance(x, DTensor) and any(p == Shard(x.ndim - 1) for p in x.placements):
            split.add(name)

    for name, m in layer.named_modules():
        if "Norm" in type(m).__name__:
            m.register_forward_pre_hook(lambda m, args, name=name: record(name, args))
    return split


def _routing(model: torch.nn.Module, plan: ModelPlan) -> list[torch.Tensor]:
    """Filled by the forward: the last layer's experts' (token, k) expert ids, tokens in batch-major order,
    one entry per call."""
    last = f"{plan.blocks}.{len(model.get_submodule(plan.blocks)) - 1}."
    experts = next(m for n, m in model.named_modules()
                   if n.startswith(last) and any(fnmatch.fnmatchcase(n, g) for g in plan.experts))
    ids: list[torch.Tensor] = []

    experts.register_forward_pre_hook(lambda module, args: ids.append(args[1].detach()))  # gathered after the trace
    return ids


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value, as rank 0 of the simulated ranks holds it."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return getattr(whole, "_local_tensors", {0: whole})[0]


def a2a_formula(strategy: hp.Strategy, config, expert_ids: torch.Tensor) -> int:
    """Rank 0's ep all-to-all bytes in one MoE layer's forward, from the routing.

    The tokens are split over the data ranks in batch-major order, the ep group of rank 0 is the
    first `ep` of them, and ep rank r holds experts [r E/ep, (r+1) E/ep).
    """
    experts = _expert_count(config)
    ep, hidden = strategy.ep, config.hidden_size
    owner = expert_ids.view(strategy.dp, -1, expert_ids.shape[-1]) // (experts // ep)  # [data rank, token, k]
    dispatched = int((owner[0] != 0).sum())  # rank 0's rows for other ranks' experts
    returned = int((owner[1:ep] == 0).sum())  # other ranks' rows for rank 0's experts, sent back
    counts = (ep - 1) * experts // ep * 8
    return counts + (dispatched + returned) * hidden * 4


def _expert_count(config) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise ValueError(f"{config.model_type}: no expert count in its config")


def runs() -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """((family, strategy) pairs, {family: why it is left out}).

    A strategy a family refuses (ring attention for eager attention, say) is printed with the reason and
    not counted.
    """
    pairs, refused = [], {}
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--families=")), None)
    for family in only or supported():
        try:
            config = tiny_config(family, layers=2)
            plan = plan_for(config)
        except Exception as error:  # a tiny config its own class rejects, or a model without a usable plan
            refused[family] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            continue
        if plan.unsplit is not None:
            refused[family] = f"{plan.unsplit} layers: dp and FSDP only"
            continue
        strategies = VL_STRATEGIES if family in VL_FAMILIES else MOE_STRATEGIES if plan.experts else STRATEGIES
        pairs += [(family, s) for s in strategies if not (family == "qwen3_vl_moe" and "vision_tp" in s)]
    return pairs, refused


def naive_plans() -> list[tuple[str, ModelPlan]]:
    """What a user gets without the zoo's knowledge: plain splits of fused weights; no residual outputs."""
    phi3, gemma = plan_for(tiny_config("phi3")), plan_for(tiny_config("gemma2"))
    unfused = {k: v.replace("[q k v]/tp", "out/tp").replace("[gate up]/tp", "out/tp") for k, v in phi3.params.items()}
    return [("phi3", ModelPlan(params=unfused, residual=phi3.residual)),
            ("gemma2", ModelPlan(params=gemma.params, residual=()))]


def _name(strategy: dict) -> str:
    order = ("dp", "ep", "cp", "cp_algorithm", "tp", "sp", "vision_tp")
    keys = sorted(strategy, key=lambda k: order.index(k) if k in order else len(order))
    return " ".join(f"{k}{'' if strategy[k] is True else strategy[k]}" for k in keys).replace("cp_algorithmring", "ring")


def table(lines: list[dict]) -> str:
    """Markdown: a row per family, a column per strategy; ok (errors under 1e-5), refused (-), or x."""
    runs_ = [r for r in lines if "family" in r and r.get("plan", "zoo") == "zoo"]
    columns = list(dict.fromkeys(_name(r["strategy"]) for r in runs_))
    cells: dict[str, dict[str, str]] = {}
    for r in runs_:
        ok = "error" not in r and "refused" not in r and r["loss_rel"] < TOLERANCE and r["grad_rel"] < TOLERANCE
        cells.setdefault(r["family"], {})[_name(r["strategy"])] = "-" if "refused" in r else "ok" if ok else "x"
    rows = ["| family | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    rows += [f"| `{f}` | " + " | ".join(c.get(k, "") for k in columns) + " |" for f, c in cells.items()]
    summary = lines[-1]
    rows += ["", *(f"- `{f}`: {why}" for f, why in summary.get("refused", {}).items())]
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        with open(sys.argv[2]) as f:
            print(table([json.loads(line) for line in f if line.startswith("{")]))
        return
    results, pairs, refused = [], *runs()
    for family, spec in pairs:
        try:
            results.append(measure(family, hp.Strategy.of(spec)))
        except hp.StrategyError as error:  # refused before running, by name: not a mismatch
            print(json.dumps({"family": family, "strategy": spec, "refused": str(error)}), flush=True)
            continue
        except Exception as error:
            results.append({"family": family, "strategy": spec, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        print(json.dumps(results[-1]), flush=True)
    for family, plan in naive_plans():
        print(json.dumps(measure(family, hp.Strategy(tp=2), plan)), flush=True)
    ok = [r for r in results if "error" not in r]
    dense = [r for r in ok if not plan_for(tiny_config(r["family"])).experts]
    summary = {
        "families": len({r["family"] for r in results}),
        "derived": len({r["family"] for r in results if r["family"] not in VL_FAMILIES}),
        "all_match": len(ok) == len(results) and all(r["loss_rel"] < TOLERANCE and r["grad_rel"] < TOLERANCE for r in ok),
        # Megatron's two all-reduces are a dense layer's: an MoE layer's experts stay whole over tp
        # a parallel block (GPT-J's attention and MLP on one norm) shares its all-gather under sp: 0.75
        "megatron_bytes": all((r["bytes_vs_megatron"] or 0) <= 1.0 and r["cp_bytes_vs_formula"] in (None, 1.0)
                              for r in dense),
        "a2a_bytes_match": all(r["a2a_bytes_vs_formula"] == 1.0 for r in ok if r["a2a_bytes_vs_formula"] is not None),
        "mismatched": sorted({r["family"] for r in results if r not in ok or r["loss_rel"] >= TOLERANCE
                              or r["grad_rel"] >= TOLERANCE}),
        "refused": refused,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

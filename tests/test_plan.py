"""`hp plan`: reference shapes as published, and dry runs at thousands of ranks that hold what the layouts say."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import rank_pool
from hp.cli import main
from hp.plan import REFERENCES, dry_run, reference_config
from hp.train.model import model_class

QUICKSTART = "examples/quickstart.yaml"

# The parameter counts of the published checkpoints (their model cards round them: 8.03B, 70.6B, 405.9B, 32.8B,
# 30.5B, 235.1B, 671B without the multi-token-prediction layer, 73.4B; Qwen2.5-0.5B's 0.49B with its head tied).
PUBLISHED = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
             "qwen3-32b": 32_762_123_264, "qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560,
             "deepseek-v3": 671_026_404_352, "qwen2.5-vl-72b": 73_410_777_344,
             "qwen2.5-0.5b": 494_032_768}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_reference_shape_has_the_published_parameter_count(name):
    config = reference_config(name)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def _llama_rank0(config, dp: int, tp: int) -> int:
    """Rank 0's parameters of a Llama under FSDP over dp and tp, from hp's layouts: the projections split over tp
    (q, k, v, gate, up and the head by rows; o and down by columns), then every tensor's rows over dp (as
    torch.chunk cuts: rank 0 takes the larger piece); the embedding and norms whole over tp."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    by_rows = lambda rows: math.ceil(math.ceil(rows / tp) / dp)  # noqa: E731
    over_dp = math.ceil(h / dp)
    layer = (by_rows(h) + 2 * by_rows(kv) + 2 * by_rows(i)) * h + over_dp * (h // tp + i // tp) + 2 * over_dp
    return config.num_hidden_layers * layer + math.ceil(v / dp) * h + by_rows(v) * h + over_dp


@pytest.mark.parametrize("name, dp, tp", [("llama-3.1-405b", 512, 8), ("llama-3.1-70b", 64, 8)])
def test_a_dry_run_at_thousands_of_ranks_holds_what_the_layouts_say(name, dp, tp):
    config = reference_config(name)
    run = dry_run(config, {"dp": dp, "tp": tp, "fsdp": True})
    assert run.world == dp * tp and run.parameters == PUBLISHED[name]
    assert run.rank_parameters == run.rank_trainable == _llama_rank0(config, dp, tp)
    assert run.state_bytes == {"parameters": 4 * run.rank_parameters, "gradients": 4 * run.rank_parameters,
                               "optimizer_states": 8 * run.rank_parameters}
    kv_rows = config.num_key_value_heads * config.head_dim
    uneven = {"model.embed_tokens.weight": config.vocab_size % dp, "lm_head.weight": config.vocab_size % (dp * tp),
              "model.layers.*.self_attn.k_proj.weight": kv_rows % (dp * tp)}
    for tensor, remainder in uneven.items():
        assert any(note.startswith(f"{tensor}: dim 0 of ") for note in run.uneven) == bool(remainder), run.uneven


def test_a_lora_run_trains_only_its_adapters_and_a_moe_spreads_its_experts(capsys):
    assert main(["plan", QUICKSTART, "finetuning_type=lora", "lora_target=all", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert 0 < lora["rank_trainable"] < lora["rank_parameters"] / 5
    assert lora["state_bytes"]["optimizer_states"] == 8 * lora["rank_trainable"]
    moe = dry_run(reference_config("qwen3-30b-a3b"), {"dp": 8, "ep": 8, "fsdp": True})
    experts = 48 * 128 * 3 * 2048 * 768  # every layer's experts, gate, up and down
    assert moe.rank_parameters == experts // 8 + (moe.parameters - experts) // 8  # all of it split 8 ways, evenly
    assert not moe.uneven


def test_hp_plan_prints_the_rank_s_model_states_and_the_splits_that_do_not_divide(capsys):
    assert main(["plan", QUICKSTART, "model_name_or_path=llama-3.1-70b", "parallel.dp=64", "parallel.tp=8",
                 "parallel.fsdp=true", "--devices", "512", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("hp plan: llama-3.1-70b, dp=64 tp=8 fsdp on 512 ranks (laid out in ")
    assert out[1] == "  parameters: 70.55 B in all, 152.19 M on rank 0"
    assert out[2].startswith("  rank 0's model states: parameters 0.57 GiB, gradients 0.57 GiB, optimizer states")
    assert out[-1] == "    lm_head.weight: dim 0 of 128256 over 512 ranks"


@pytest.mark.parametrize("overrides, message", [
    (["model_name_or_path=llama-9"], "hp plan: no reference shape 'llama-9': hp plan knows deepseek-v3, "
                                     "llama-3.1-405b,"),
    (["--devices", "3"], "hp plan: --devices 3: the config's parallel section (tp=2) runs on 2 ranks; set its "
                         "degrees to multiply to 3"),
    (["parallel.pp=2"], "hp plan: pp = 2: hp plan --dry-run does not cut pipeline stages yet"),
    (["parallel.tp=3"], "hp plan: parallel.tp = 3 does not divide num_attention_heads = 4 of the model"),  # hp train's
    (["learning_rate=fast"], "hp plan: learning_rate = 'fast'"),
    (["--device", "v100"], "hp plan: device 'v100' has no profile: expected one of h100-80g, h200-141g, a100-80g, "
                           "910b-64g, cpu"),
    (["--devices-per-node", "3"], "hp plan: --devices-per-node 3: 2 devices do not fill whole nodes of 3"),
    (["cluster.devices_per_node=3"], "hp plan: cluster.devices_per_node = 3: 2 devices do not fill whole nodes of 3"),
    (["cluster.devices=0"], "hp plan: cluster.devices = 0: expected a positive integer"),
    (["cluster.devics=8"], "hp plan: unknown key 'cluster.devics' = 8; did you mean 'cluster.devices'?"),
    (["cluster.device=v100"], "hp plan: device 'v100' has no profile: expected one of h100-80g,"),
    (["cluster.device={memory_gib: 96}"], "hp plan: cluster.device has no tflops: a device spelled out needs "
                                          "memory_gib and tflops"),
    (["cluster.device={memory_gib: 96, tflops: {int8: 2000}}"], "hp plan: unknown key 'cluster.device.tflops.int8'"),
    (["cluster.device={memory_gib: 96, tflops: {bf16: 989}, memory_bandwidth_gb_s: 0}"],
     "hp plan: cluster.device.memory_bandwidth_gb_s = 0: expected a positive number"),
    (["cluster.device={memory_gib: 96, tflops: {bf16: 989}, inter_node: {bandwidth_gb_s: 50}}"],
     "hp plan: cluster.device.inter_node = {'bandwidth_gb_s': 50}: expected a mapping of bandwidth_gb_s and latency_us"),
])
def test_what_hp_plan_cannot_plan_is_one_message_and_exit_code_2(overrides, message, capsys):
    assert main(["plan", QUICKSTART, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_the_cluster_section_plans_as_its_flags_do_and_a_flag_wins(capsys):
    seventy = [QUICKSTART, "model_name_or_path=llama-3.1-70b", "parallel.dp=64", "parallel.tp=8", "parallel.fsdp=true"]
    plans = []
    for section, flags in (([], ["--devices", "512", "--devices-per-node", "8", "--device", "h100-80g"]),
                           (["cluster.devices=512", "cluster.devices_per_node=8", "cluster.device=h100-80g"], []),
                           (["cluster.devices=512", "cluster.device=a100-80g"], ["--device", "h100-80g"])):
        assert main(["plan", *seventy, *section, *flags, "--json", "--dry-run"]) == 0
        plan = json.loads(capsys.readouterr().out)
        plans.append({k: plan[k] for k in ("world", "rank_parameters", "state_bytes", "device", "device_memory_bytes")})
    assert plans[0] == plans[1] == plans[2] and plans[0]["world"] == 512 and plans[0]["device"] == "h100-80g"
    # a device spelled out: its memory, as a named profile's
    figures = ("{name: b200, memory_gib: 180, tflops: {bf16: 2250}, memory_bandwidth_gb_s: 8000, "
               "intra_node: {bandwidth_gb_s: 900, latency_us: 5}}")
    assert main(["plan", *seventy, f"cluster.device={figures}", "--devices", "512", "--json", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"] == "b200" and plan["device_memory_bytes"] == 180 * 2**30
    assert plan["model_states_share"] == pytest.approx(sum(plan["state_bytes"].values()) / (180 * 2**30), abs=1e-4)
    assert main(["train", QUICKSTART, "cluster.devices=0"]) == 2  # hp train checks the section too
    assert capsys.readouterr().err.startswith("hp train: cluster.devices = 0: expected a positive integer")


def test_a_device_s_memory_against_rank_0_s_model_states(capsys):
    """On a named profile: the share the model states take; where they alone exceed the device, the plan is
    printed, then one message with the shortfall and what would make it fit (exit code 2)."""
    from hp.plan.devices import PROFILES

    seventy = [QUICKSTART, "model_name_or_path=llama-3.1-70b", "parallel.tp=8"]
    assert main(["plan", *seventy, "parallel.dp=16", "parallel.fsdp=true", "--device", "h100-80g",
                 "--devices-per-node", "8", "--json", "--dry-run"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert fits["device_memory_bytes"] == PROFILES["h100-80g"].memory_bytes == 81559 * 2**20
    assert fits["model_states_share"] == pytest.approx(sum(fits["state_bytes"].values()) / 81559 / 2**20, abs=1e-4)
    assert main(["plan", *seventy, "parallel.dp=2", "--device", "h100-80g", "--json"]) == 2
    need = 16 * json.loads(capsys.readouterr().out)["rank_parameters"]  # fp32 weights, gradients, two moments
    assert main(["plan", *seventy, "parallel.dp=2", "--device", "h100-80g"]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].startswith("  on h100-80g (79.65 GiB): the model states take "
                                                    f"{need / (81559 * 2**20):.0%}")
    message = captured.err.strip()
    assert message == (f"hp plan: rank 0's model states alone need {need / 2**30:.2f} GiB, "
                       f"{(need - 81559 * 2**20) / 2**30:.2f} GiB more than h100-80g's 79.65 GiB: shard them with "
                       "FSDP (parallel.fsdp: true) or over more ranks, split the model (tp, pp), train LoRA adapters, "
                       "or offload the optimizer states")
    # the cpu profile's figures: tests/test_plan_time.py, where hp plan measures it


@pytest.mark.parametrize("strategy", [{"tp": 2, "sp": True, "recompute": True}, {"cp": 2, "cp_algorithm": "ring"},
                                      {"dp": 2, "fsdp": True}, {"dp": 2, "tp": 2, "fsdp": True}])
def test_the_traced_step_holds_what_the_same_step_allocates_on_real_tensors(strategy):
    """Rank 0's step traced on fake tensors against the same step run on real ones (every tensor allocated, the
    fake world's collectives moving no values): the same peak, kind by kind. Under plain data parallel (dp with
    FSDP) the trace supervises every position without reading the labels, which the real step reads: within 0.5%.
    benchmarks/plan.py measures 26 configurations, 17 of them on 2 gloo processes."""
    from hp.models import tiny_config
    from hp.plan.memory import measure_step, trace_step
    from hp.plan.step import StepShape

    config, shape = tiny_config("llama", layers=2), StepShape(rows=4, tokens=32)
    traced, measured = trace_step(config, strategy, shape), measure_step(config, strategy, shape)
    if strategy.get("tp") or strategy.get("cp"):
        assert traced == measured
    assert abs(traced.peak - measured.peak) <= 0.005 * measured.peak, (traced, measured)
    assert traced.model_states == measured.model_states


def test_hp_plan_prints_rank_0_s_step_and_says_what_it_cannot_trace(capsys):
    assert main(["plan", QUICKSTART, "parallel.tp=1", "parallel.dp=2", "parallel.fsdp=true", "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["step_memory"]
    assert step["peak"] == sum(v for k, v in step.items() if k not in ("peak", "model_states"))
    assert step["activations"] > 0 and step["optimizer_states"] > 0
    # with a device, the step's peak against its memory and its time: tests/test_plan_time.py (on cpu, measured)
    assert main(["plan", QUICKSTART, "model_name_or_path=hp/tiny-qwen3-moe", "parallel.tp=1", "parallel.dp=2",
                 "parallel.ep=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["untraced"].startswith("hp plan traces no mixture-of-experts step")
    # a step whose peak exceeds the device: the plan, then one message with the shortfall and what would fit
    assert main(["plan", QUICKSTART, "per_device_train_batch_size=2048", "cutoff_len=8192", "--device", "h100-80g"]) == 2
    captured = capsys.readouterr()
    assert "the step's peak" in captured.out.splitlines()[-1]
    assert captured.err.startswith("hp plan: rank 0's step peaks at ") and "GiB more than h100-80g's 79.65 GiB" in \
        captured.err and "recompute the blocks" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_the_traced_step_counts_the_buffers_gloo_allocates_beside_a_collective():
    run = rank_pool.run(str(Path(__file__).parent / "workers" / "plan_gloo.py"), 2, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0: traced as measured on gloo" in run.stdout

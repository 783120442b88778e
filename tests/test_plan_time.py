"""`hp plan`'s step time: the work a traced step counts, and its seconds on a device's figures.

The prediction's accuracy is measured by benchmarks/plan.py against steps run on 2 gloo processes; here, that the
work counted is the step's (torch's own FLOP counter on the same step run for real, hp.comm.trace's collectives on
a simulated one) and that the figures combine as `hp.plan.step_time` says.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from torch.utils.flop_counter import FlopCounterMode

from hp.models import tiny_config
from hp.plan.devices import PROFILES, DeviceProfile, Link
from hp.plan.kernels import Kernel
from hp.plan.step import StepShape, real_step
from hp.plan.step_time import StepWork, predict, trace_work
from hp.parallel.apply import strategy_mesh
from hp.parallel.strategy import Strategy
from hp.watch import Collective

SHAPE = StepShape(rows=4, tokens=32)


def _real_step_flops(config, strategy: dict) -> float:
    """torch's FLOP counter over the second step of the same model, laid out alike, on real tensors."""
    step = real_step(config, strategy, SHAPE)
    with FlopCounterMode(display=False) as counter:
        step.run()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_traced_step_counts_the_flops_torch_counts_on_the_real_step(family):
    config = tiny_config(family, layers=2)
    work = trace_work(config, {"dp": 1}, SHAPE)
    # torch counts the accelerators' attention kernels, not the CPU's; hp counts the CPU's as theirs
    attention = sum(k.flops for k in work.kernels if k.attention)
    # the real step's head skips each row's last position, which has no target: the labels' values say so, which
    # fake tensors do not hold (its forward and two backward matmuls, rows x hidden x vocab each)
    unread = 3 * 2 * SHAPE.rows * config.hidden_size * config.vocab_size
    assert work.flops - attention - unread == _real_step_flops(config, {"dp": 1}) > 0 and attention > 0
    assert not work.collectives and work.ops > len(work.kernels) > 0  # views and allocations: ops, no traffic


def test_the_traced_collectives_are_those_of_the_simulated_step():
    """tp=2 with sequence parallel: the same collectives, kind, axis and bytes, as hp.comm.trace counts on the step
    run on real tensors over a simulated world."""
    import hp

    config, strategy = tiny_config("llama", layers=2), Strategy.of({"tp": 2, "sp": True})
    work = trace_work(config, strategy, SHAPE)
    with hp.simulated(strategy_mesh(strategy, simulate=True)):
        step = real_step(config, strategy, SHAPE)
        with hp.comm.trace() as seen:
            step.run()
    counted = sorted((c.kind, c.axis, c.bytes) for c, _ in work.collectives)
    assert counted == sorted((c.kind, c.axis, c.bytes) for c in seen.records) and counted
    assert work.dtensor_ops > 0


def test_a_step_s_seconds_add_on_a_cpu_and_overlap_on_an_accelerator():
    """Each kernel's roofline, the host's dispatch (added on a CPU, the longer of the two on an accelerator), and
    alpha-beta per collective, over the inter-node link once its group spans nodes."""
    link, slow = Link(bandwidth=1e9, latency=1e-3), Link(bandwidth=1e8, latency=1e-2)
    device = DeviceProfile("d", 1, (("fp32", 1e9),), link, slow, devices_per_node=4, memory_bandwidth=1e9,
                           op_overhead=1e-3, dtensor_overhead=1e-2)
    kernels = (Kernel(flops=2e9, bytes=10**8, dtype="fp32"),  # 2 s of arithmetic, 0.1 s of traffic
               Kernel(flops=0.0, bytes=5 * 10**8, dtype="fp32"))  # 0.5 s of traffic
    gather = Collective("all_gather", "tp", 2, 2 * 10**6, 10**6, "forward", "")
    work = StepWork(kernels, ops=10, dtensor_ops=2, collectives=((gather, 1), (gather, 4)))
    step = predict(work, device)
    assert step.compute == pytest.approx(2.5) and step.host == pytest.approx(10e-3 + 2e-2)
    # within a node: one ring step and 1 MB at 1 GB/s; across (stride 4 x 2 ranks > 4 per node): at 100 MB/s
    assert step.communication == pytest.approx((1e-3 + 1e-3) + (1e-2 + 1e-2))
    assert step.total == pytest.approx(2.5 + 0.022)  # the host's 0.03 s of launches run ahead of the device
    on_host = predict(work, dataclasses.replace(device, host_is_device=True))
    assert on_host.total == pytest.approx(2.5 + 0.03 + 0.022)  # a CPU dispatches and computes in turn
    busy_host = StepWork(kernels, ops=10_000, dtensor_ops=0, collectives=())
    assert predict(busy_host, device).total == pytest.approx(10.0)  # the host's 10 s, the device's 2.5 s under it
    assert predict(busy_host, dataclasses.replace(device, host_is_device=True)).total == \
        pytest.approx(12.5)


def test_a_named_device_times_a_planned_step_and_an_unknown_link_is_said(capsys):
    """`hp plan --device` adds rank 0's step time to the plan; the cpu profile measured without its links times
    the kernels and says how many collectives it could not, and holds this machine's figures (measured once a
    process: hp plan's and `profile("cpu")`'s are one)."""
    from hp.cli import main
    from hp.plan.devices import profile

    common = ["plan", "examples/quickstart.yaml", "cutoff_len=32", "per_device_train_batch_size=2", "--json"]
    assert main([*common, "--device", "h100-80g"]) == 0
    step = json.loads(capsys.readouterr().out)["step_time"]
    assert step["total_s"] == pytest.approx(max(step["compute_s"], step["host_s"]) + step["communication_s"])
    assert step["communication_s"] > 0 and step["untimed_collectives"] == 0
    assert main(["plan", "examples/quickstart.yaml", "cutoff_len=32", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].startswith("  rank 0's step (traced): peak ") and "activations" in lines[-3]
    assert lines[-2].startswith("  on cpu (") and "the step's peak" in lines[-2]
    line = lines[-1]
    assert line.startswith("  rank 0's step on cpu: ") and "collectives not timed: cpu has no figures" in line
    cpu = profile("cpu")
    assert cpu.memory_bytes > 2**30 and cpu.peak("fp32") > 1e8 and cpu.intra_node is None and cpu.backend == "gloo"


def test_a_named_profile_has_its_memory_bandwidth():
    assert {name: p.memory_bandwidth / 1e12 for name, p in PROFILES.items()} == {
        "h100-80g": 3.35, "h200-141g": 4.8, "a100-80g": 2.039, "910b-64g": 1.6}


def test_hp_plan_search_ranks_the_world_s_splits_and_parallel_auto_trains_the_fastest(capsys, tmp_path):
    """`--search` on one rank (the candidates plain and recomputing, so that the test stays short: every split of
    2 ranks is ranked by benchmarks/plan.py): each row is its step traced alone, the faster first (the table's
    layout: `render_search`'s example). `parallel: auto` on the same config takes the first, says why, and hands it
    to the launch as one override, with which the run trains (on a CPU, `hp.plan.devices.local_profile` measures
    the device as the benchmark does). Without a device, without ranks to split, beside another sharding key, and
    where nothing fits the device, one message each, before any worker starts."""
    from hp.cli import main
    from hp.plan.auto import resolve
    from hp.plan.dry_run import hf_config_of
    from hp.plan.memory import trace_step
    from hp.train.config import ConfigError, load_config
    from hp.train.launch import checked
    from train_runs import DATA, QUICKSTART, hp_train, summary

    given = ["cutoff_len=32", "per_device_train_batch_size=2", "disable_gradient_checkpointing=false"]

    def common(*overrides: str) -> list[str]:
        return ["plan", "examples/quickstart.yaml", *given, *overrides, "--devices", "1", "--search"]

    assert main([*common(), "--device", "h100-80g", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["candidates"]
    assert [c["strategy"] for c in ranked] == [{}, {"recompute": True}]  # recompute runs each block's forward again
    config, shape = hf_config_of("hp/tiny-llama"), StepShape(rows=2, tokens=32)
    for candidate in ranked:
        assert candidate["step_s"] == pytest.approx(
            predict(trace_work(config, candidate["strategy"], shape), PROFILES["h100-80g"]).total, rel=1e-9)
        assert candidate["peak_bytes"] == trace_step(config, candidate["strategy"], shape).peak
        assert candidate["tokens_per_s"] == pytest.approx(64 / candidate["step_s"])
    auto = [*given, "parallel=auto", "nproc_per_node=1", "cluster.device=h100-80g", f"dataset_dir={DATA}"]
    with pytest.raises(ConfigError, match="parallel = 'auto' is chosen by the hp train command before the launch"):
        checked(QUICKSTART, auto)  # the trainer itself does not search
    overrides = resolve(QUICKSTART, auto)
    assert overrides == [*auto, 'parallel={"recompute": false}'], overrides
    assert capsys.readouterr().err == (
        "hp train: parallel: auto takes one rank on 1 ranks of h100-80g: the fastest of the 2 of 2 candidates that fit "
        f"(hp plan --search), its step {ranked[0]['step_s'] * 1e3:.1f} ms predicted, {ranked[0]['tokens_per_s']:.0f} "
        f"tokens/s, peak {ranked[0]['peak_bytes'] / 2**30:.2f} of 79.65 GiB; next, one rank recompute, "
        f"{ranked[1]['step_s'] / ranked[0]['step_s']:.2f}x its step\n")
    result = summary(hp_train(*overrides, "max_steps=2", f"output_dir={tmp_path}"))
    assert result["steps"] == 2 and not load_config(QUICKSTART, overrides).parallel.recompute
    assert main(common()) == 2
    assert capsys.readouterr().err.startswith("hp plan: hp plan --search prices each candidate's step on a device")
    tiny = "cluster.device={memory_gib: 0.001, tflops: {fp32: 1}}"
    assert main(common(tiny)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hp plan: no candidate runs on 1 ranks of custom: peaks at") and "over custom's" in err, err
    assert main(["train", QUICKSTART, *auto[:-2], tiny]) == 2  # hp train's parallel: auto says the same
    assert capsys.readouterr().err == "hp train" + err[len("hp plan"):]
    assert main(["train", QUICKSTART, "parallel=auto"]) == 2
    assert capsys.readouterr().err.startswith("hp train: parallel = 'auto' splits the ranks hp train launches: set "
                                              "nproc_per_node")
    assert main(["train", QUICKSTART, "parallel=auto", "nproc_per_node=2", "fsdp=full_shard"]) == 2
    assert "parallel = 'auto' chooses every degree itself: leave fsdp out" in capsys.readouterr().err

"""Real multi-process runs over gloo, on ranks forked fresh for each job by the pytest worker's zygote
(`rank_pool`); the launch helper's own timeout is checked on a real torchrun launch.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import rank_pool
from gloo_launch import assert_finished, torchrun

HERE = Path(__file__).parent


def test_shard_constrain_from_local_on_four_gloo_processes():
    run = rank_pool.run(str(HERE / "workers" / "annotate_gloo.py"), 4)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1", "2", "3"]


def test_collectives_in_flight_while_the_rank_computes_on_landed_ones():
    """hp.mpmd's pattern on gloo: several gathers, reduce-scatters and all-to-alls in flight, landed ones
    multiplied meanwhile; every result right and no process lost (functional collectives crashed here)."""
    run = rank_pool.run(str(HERE / "workers" / "pipelined_gloo.py"), 2, "300")
    assert_finished(run)
    assert sorted(re.findall(r"ok (\d)", run.stdout)) == ["0", "1"]


PLAIN_LAUNCH = """
import torch, torch.distributed as dist, hp
mesh = hp.mesh(tp=1)                       # a plain launch is a 1-rank world
assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
x = hp.shard(torch.arange(6.0).reshape(2, 3), "b h/tp", mesh)
assert hp.describe(x) == "f32[b=2, h=3/tp]" and torch.equal(x.full_tensor(), x.to_local())
for call, words in [
    (lambda: hp.mesh(tp=2), "needs 2 processes but this run has 1"),
    (lambda: hp.mesh(tp=2, simulate=True), "needs a process without a real process group"),
]:
    try:
        call()
    except hp.MeshError as e:
        assert words in str(e), str(e)
    else:
        raise AssertionError("no error for: " + words)
print("plain ok")
"""


def test_plain_launch_is_a_one_rank_world_and_sizes_are_checked():
    run = rank_pool.python("-c", PLAIN_LAUNCH, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plain ok" in run.stdout


def test_a_launch_past_its_timeout_leaves_no_worker_behind(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        torchrun(str(script), 2, timeout=12)
    assert stopped.value.output.count("started") == 2, stopped.value.output  # both workers ran before the stop
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    assert not left, f"workers still running: {left}"


def test_zoo_strategies_on_four_gloo_processes():
    # About two minutes on 2 shared cores, most of it DTensor planning each new layout once per process.
    run = rank_pool.run(str(HERE / "workers" / "zoo_gloo.py"), 4, timeout=600)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1", "2", "3"]


def test_vl_families_with_images_under_fsdp_cp_and_ep_on_two_gloo_processes():
    run = rank_pool.run(str(HERE / "workers" / "vl_gloo.py"), 2, timeout=600)
    assert_finished(run)
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_compiled_blocks_follow_hf_on_gloo_processes(ranks):
    # 2 ranks: tp+sp, cp ring and Ulysses, FSDP, tp through Qwen2.5-VL's decoder, and a MoE's experts under dp and ep;
    # 4 ranks: the 2D and SUMMA layouts (aot_eager).
    run = rank_pool.run(str(HERE / "workers" / "compile_gloo.py"), ranks, timeout=600)
    assert_finished(run)
    assert len(re.findall(r"compiled blocks follow the reference", run.stdout)) == ranks

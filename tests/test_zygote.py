"""The node's zygote (`hp.train.zygote`) and the stand-ins that torch's elastic agent watches in place of workers.

`hp train`'s own tests show the zygote's workers end to end: a worker killed by
a signal is reported as killed by it (the stand-in ends as its worker ended),
SIGINT and SIGTERM stop every worker (the stand-ins pass them on), a launcher
SIGKILLed takes everything with it, and a group restarts from the same zygote
(tests/test_failures.py, tests/test_train.py). Here, what the agent does only
as its last resort when a worker ignores SIGTERM: it SIGKILLs the stand-in,
which cannot pass that on, and the zygote ends the worker itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gloo_launch import _free_port, clean_env
from train_runs import DATA, QUICKSTART, ROOT, ranks

from hp.train import zygote


def test_a_stand_in_killed_takes_its_worker_with_it(tmp_path):
    out = tmp_path / "run"
    argv = [QUICKSTART, f"dataset_dir={DATA}", "parallel.tp=1", "max_steps=500", "logging_steps=1", f"output_dir={out}"]
    env = {**clean_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    with zygote.started(str(tmp_path), argv) as command:
        stand_in = subprocess.Popen([sys.executable, *command], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
            assert stand_in.poll() is None and time.time() < deadline, stand_in.communicate()
            time.sleep(0.05)
        worker = ranks(str(out))[0]  # named `hp rank 0`, with the zygote's command line
        stand_in.kill()
        stand_in.wait()
        deadline = time.time() + 30
        while Path(f"/proc/{worker}").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists(), "the worker outlived its stand-in"

"""`ray job submit` of the real job against a separately started `ray start --head` cluster."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_forge.local_cluster import LocalCluster, NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture
def head_node():
    """A 2-CPU head node with the dashboard's job server, in its own process group with free ports
    (the session's own test cluster holds Ray's defaults)."""
    with LocalCluster([NodeSpec("127.0.0.2", num_cpus=2)], dashboard=True) as cluster:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            probe = subprocess.run([str(BIN / "ray"), "job", "list", "--address", cluster.dashboard_url],
                                   capture_output=True, text=True, env=cluster.env, timeout=60)
            if probe.returncode == 0:
                break
            time.sleep(2)
        else:
            pytest.fail("the head node's job server did not come up in 90 s")
        yield cluster.dashboard_url, cluster.env


def test_ray_job_submit_runs_the_job(head_node, tmp_path):
    address, env = head_node
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
           "python", "jobs/grpo.py", "--config", "jobs/configs/blackjack_tiny.yaml",
           "run.steps=2", "run.eval_every=2", "run.eval_mc_games=200", "grpo.games_per_step=64",
           f"run.output_dir={tmp_path}", "model.tiny.num_layers=2", "policy.kv_cache_mb=64"]
    # The head's job agent can register a minute or more after the job API answers on a busy
    # 2-core machine; until then every submit is refused, and nothing has run.
    deadline = time.monotonic() + 240
    while True:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        out = proc.stdout + proc.stderr
        if "No available agent" not in out or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out.lower()
    assert "joined Ray cluster" in out  # it used the submitted-to cluster, not an embedded one
    runs = list(tmp_path.glob("blackjack-tiny-*/final_policy/model.safetensors"))
    assert len(runs) == 1

"""`ray job submit` of the real job against a separately started `ray start --head` cluster."""

from pathlib import Path

import pytest

from ray_forge.local_cluster import LocalCluster, NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def head_node():
    """A 2-CPU head node with the dashboard's job server, in its own process group with free ports
    (the session's own test cluster holds Ray's defaults)."""
    with LocalCluster([NodeSpec("127.0.0.2", num_cpus=2)], dashboard=True) as cluster:
        cluster.wait_for_jobs()
        yield cluster


def test_ray_job_submit_runs_the_job(head_node, tmp_path):
    _, proc = head_node.submit(["python", "jobs/grpo.py", "--config", "jobs/configs/blackjack_tiny.yaml",
                             "run.steps=2", "run.eval_every=2", "run.eval_mc_games=200", "grpo.games_per_step=64",
                             f"run.output_dir={tmp_path}", "model.tiny.num_layers=2", "policy.kv_cache_mb=64"],
                            ROOT, "submit-test", timeout_s=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out.lower()
    assert "joined Ray cluster" in out  # it used the submitted-to cluster, not an embedded one
    runs = list(tmp_path.glob("blackjack-tiny-*/final_policy/model.safetensors"))
    assert len(runs) == 1

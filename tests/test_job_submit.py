"""`ray job submit` of the real job against a separately started `ray start --head` cluster."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def head_node(tmp_path):
    """A 2-CPU head node in its own process group (so stopping it cannot touch other clusters)."""
    gcs_port, dashboard_port = _free_port(), _free_port()
    # Every port the head opens is chosen here: the session's own test cluster already holds
    # Ray's defaults (the dashboard agent's 52365 among them), and an agent that cannot bind
    # leaves the job server answering "No available agent" forever.
    agent_ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                   f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
                   f"--ray-client-server-port={_free_port()}"]
    # Ray 2.60 turns token auth on for `ray start` once ~/.ray/auth_token exists (any local
    # ray.init() writes one); the `ray job` CLI then needs the mode set too.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
               PATH=f"{BIN}:{os.environ['PATH']}")  # the entrypoint's `python` is this venv's, as when activated
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path("/tmp") / f"rf_submit_{os.getpid()}"  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         "--memory=6000000000", "--object-store-memory=500000000", f"--temp-dir={temp_dir}",
         "--include-dashboard=true", *agent_ports],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            probe = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address],
                                   capture_output=True, text=True, env=env, timeout=60)
            if probe.returncode == 0:
                break
            time.sleep(2)
        else:
            pytest.fail("the head node's job server did not come up in 90 s")
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-f", str(temp_dir)], check=False)


def test_ray_job_submit_runs_the_job(head_node, tmp_path):
    address, env = head_node
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
           "python", "jobs/blackjack_grpo.py", "--config", "jobs/configs/blackjack_tiny.yaml",
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

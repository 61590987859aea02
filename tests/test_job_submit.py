"""`ray job submit` of the real job against a separately started `ray start --head` cluster."""

from pathlib import Path

import pytest

from ray_forge.cluster.local import LocalCluster, NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def head_node():
    """A 2-CPU head node with the dashboard's job server, in its own process group with free ports
    (the session's own test cluster holds Ray's defaults)."""
    with LocalCluster([NodeSpec("127.0.0.2", num_cpus=2)], dashboard=True) as cluster:
        cluster.wait_for_jobs()
        yield cluster


def driver_pids(marker: str) -> list[int]:
    """Python processes running jobs/grpo.py with ``marker`` in their arguments (the job's driver,
    not the shell the job agent starts it with)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if "python" in Path(argv[0]).name and "jobs/grpo.py" in argv and any(marker in a for a in argv):
            pids.append(int(proc.name))
    return pids


def test_a_job_whose_driver_is_killed_finishes_when_submitted_again_with_resume_auto(head_node, tmp_path):
    """`ray job submit` runs the job on the cluster it was submitted to (not an embedded one); a
    driver killed mid-run, as a preempted head pod's would be, finishes when submitted again."""
    import json
    import os
    import signal
    import time

    args = ["python", "jobs/grpo.py", "--config", "jobs/configs/blackjack_tiny.yaml", "--resume", "auto",
            "run.steps=6", "run.checkpoint_every=2", "run.eval_every=0", "env.options.blackjack.mc_games=200",
            "grpo.prompts_per_step=8", f"run.output_dir={tmp_path}", "model.tiny.num_layers=2", "policy.kv_cache_mb=64",
            "run.progress=false"]
    job_id, proc = head_node.submit(args, ROOT, "resume-first", wait=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    deadline = time.monotonic() + 600
    while not list(tmp_path.glob("*/checkpoints/step-00000002/manifest.json")):
        assert time.monotonic() < deadline, "the first submission did not write a checkpoint in time"
        time.sleep(0.2)
    [pid] = driver_pids(str(tmp_path))
    os.kill(pid, signal.SIGKILL)  # the driver dies as a preempted head pod's would
    [run_dir] = list(tmp_path.iterdir())
    assert not (run_dir / "eval.json").exists()

    _, proc = head_node.submit(args, ROOT, "resume-second", timeout_s=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out.lower(), out[-4000:]
    assert "(resumed)" in out and f"resumed {run_dir}" in out
    assert "joined Ray cluster" in out  # the submitted-to cluster, not an embedded one
    assert list(tmp_path.iterdir()) == [run_dir]  # the same run continued; no second run directory
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "final_policy" / "model.safetensors").is_file()


FAKE_RAY = """#!/bin/sh
# A stand-in for the ray CLI: its first submit is cut off after the job was accepted.
state="$(dirname "$0")/submitted"
case "$2" in
  submit) echo "submit $*" >> "$state.log"
          if [ ! -e "$state" ]; then touch "$state"; echo "urllib3.exceptions.ProtocolError: ('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))" >&2; exit 1; fi
          echo "Job 'x' already exists" >&2; exit 1;;
  status) [ -e "$state" ] || exit 1; echo "Job 'x' succeeded";;
  logs) echo "the job's own log";;
esac
"""


def test_a_submit_cut_off_after_the_job_was_accepted_follows_that_job(tmp_path):
    """On a busy machine the dashboard may drop the submitting request after accepting the job:
    the job is followed, not submitted a second time (a second run would share its output dir)."""
    fake = tmp_path / "ray"
    fake.write_text(FAKE_RAY)
    fake.chmod(0o755)
    cluster = LocalCluster([NodeSpec("127.0.0.2", num_cpus=1)], dashboard=True)
    cluster.ray = str(fake)
    job_id, proc = cluster.submit(["python", "-c", "pass"], ROOT, "cut-off", timeout_s=60)
    assert job_id == "cut-off" and proc.returncode == 0
    assert "the job's own log" in proc.stdout and "succeeded" in proc.stdout
    assert len((tmp_path / "submitted.log").read_text().splitlines()) == 1  # submitted once

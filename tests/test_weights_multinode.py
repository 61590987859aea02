"""The weight store across two Ray nodes (127.0.0.2 and 127.0.0.3 on this machine): the bench's
cross-node cases, small, run as a subprocess (this test session's own cluster holds ray.init)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parent.parent


def test_object_store_transport_is_exact_across_nodes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "weight_sync.py"), "--gb", "0.04", "--tensors", "10", "--reps", "1",
         "--bucket-mb", "4", "--only", "object_store_cross_node", "shm_to_bf16"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["all_exact"] is True
    cross = result["object_store_cross_node"]
    assert cross["exact"] and len(cross["receiver_gbps"]) == 2 and min(cross["receiver_gbps"]) > 0
    assert result["shm_to_bf16"]["exact"]  # fp32 -> bf16 on the wire equals .to(bfloat16)

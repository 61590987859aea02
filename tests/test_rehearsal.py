"""The multi-node rehearsal: two labelled Ray nodes on one machine, the job via `ray job submit`,
every actor on its pool's node (read from Ray's state API), the job SUCCEEDED."""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent


def test_rehearsal_places_every_actor_on_its_pool_and_the_job_succeeds(tmp_path):
    from cluster import rehearse

    result = rehearse.rehearse([], tmp_path)
    assert result["status"] == "SUCCEEDED", result["log_tail"]
    assert result["problems"] == []
    where = result["placement"]
    assert {name for name in where} >= {"policy-0", "policy-1", "trainer-0", "ref", "env-0"}
    for name, info in where.items():
        expected = ("127.0.0.3", "cpu") if name.startswith("env-") else ("127.0.0.2", "gpu")
        assert (info["node_ip"], info["pool"]) == expected, name
    assert len(list(tmp_path.glob("blackjack-tiny-*/final_policy/model.safetensors"))) == 1


def test_misplaced_actors_are_reported():
    from cluster import rehearse

    where = {"policy-0": {"node_ip": "127.0.0.3", "pool": "cpu"}, "env-0": {"node_ip": "127.0.0.3", "pool": "cpu"},
             "trainer-0": {"node_ip": "127.0.0.2", "pool": "gpu"}}
    problems = rehearse.misplaced(where)
    assert any(p.startswith("policy-0 ran on 127.0.0.3") for p in problems)
    assert "no ref actor was found" in problems and len(problems) == 2

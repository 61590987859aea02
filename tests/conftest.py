"""Shared fixtures. Ray tests share one local cluster with an explicit CPU count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _init_session_ray() -> None:
    import ray

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, object_store_memory=512 * 2**20,
             namespace="ray_forge_tests", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-CPU local Ray cluster for the whole session, shut down at the end."""
    import ray

    _init_session_ray()
    yield ray
    ray.shutdown()


def _without_session_ray():
    """For tests whose process joins a cluster of their own (``LocalCluster.connect``): a process
    holds one Ray connection, so the session's cluster, if an earlier test started it, is shut
    down first and started again after (later tests get ``ray_cluster`` as it was)."""
    import ray

    had_session = ray.is_initialized()
    if had_session:
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if had_session:
        _init_session_ray()


own_ray_cluster = pytest.fixture(_without_session_ray)
own_ray_cluster_for_module = pytest.fixture(scope="module")(_without_session_ray)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 with the BlackJack tokenizer, made once per session."""
    from envs.blackjack import BlackjackTextEnv
    from ray_forge.config.schema import TinyModelConfig
    from ray_forge.models.tiny import make_tiny_qwen3

    folder = tmp_path_factory.mktemp("models") / "tiny_qwen3"
    return str(make_tiny_qwen3(folder, BlackjackTextEnv.corpus(),
                               TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)))

"""OpenEnv interop, both ways, against real OpenEnv servers (OpenEnv's ``create_app``) on loopback.

(a) ray_forge's adapter plays OpenSpiel BlackJack served over OpenEnv; (b) ray_forge's own envs
served over OpenEnv are driven by OpenEnv's own client.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest

pyspiel = pytest.importorskip("pyspiel", reason="open_spiel is installed by `make` (the openenv extra)")
pytest.importorskip("openenv", reason="openenv-core is installed by `make` (the openenv extra)")

import openspiel_server  # noqa: E402  (after the skips: it imports open_spiel)

from envs import registry  # noqa: E402
from envs.blackjack import BlackjackTextEnv, State, render_state  # noqa: E402
from envs.openenv_adapter import OpenEnvError, OpenEnvOptions, OpenEnvTextEnv, blackjack_state  # noqa: E402
from ray_forge.actors.env_pool import EnvPool  # noqa: E402
from ray_forge.config import ConfigError  # noqa: E402
from ray_forge.config.schema import EnvConfig  # noqa: E402
from ray_forge.net import free_port  # noqa: E402
from servers import serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def openspiel_url():
    with serving("tests/openspiel_server.py") as (url, _):
        yield url


@pytest.fixture(scope="module")
def blackjack_url():
    with serving("-m", "envs.openenv_server") as (url, _):
        yield url


# -- (a) the adapter, against OpenSpiel BlackJack over OpenEnv -----------------------------------

_CARD = re.compile(r"[CDHS]([A2-9TJQK])")
_RANKS = "A23456789TJQK"


def true_state(state) -> State:
    """The player's hand and the dealer's face-up card, read from OpenSpiel's own text."""
    text = state.observation_string(0)
    player = [min(_RANKS.index(r) + 1, 10) for r in _CARD.findall(re.search(r"Player 0: Cards: (.*)", text)[1])]
    dealer = [min(_RANKS.index(r) + 1, 10) for r in _CARD.findall(re.search(r"Dealer: Cards: (.*)", text)[1])]
    total = sum(player)
    soft = 1 in player and total + 10 <= 21
    return State(total + 10 if soft else total, dealer[-1], soft)


def threshold(prompt: str) -> str:
    return "HIT" if int(re.search(r"sum is (\d+)", prompt)[1]) < 17 else "STICK"


def test_blackjack_observation_decoding_matches_openspiel():
    rng = np.random.default_rng(0)
    checked = 0
    for seed in range(400):
        state, deal_rng = openspiel_server.new_game(seed)
        while not state.is_terminal():
            decoded = blackjack_state(state.observation_tensor(0))
            assert decoded == true_state(state), state.observation_string(0)
            checked += 1
            state.apply_action(int(rng.integers(2)))
            openspiel_server.play_chance(state, deal_rng)
    assert checked > 500  # many states after one or more hits, not just the deals
    with pytest.raises(OpenEnvError, match="expected 189"):
        blackjack_state([0.0] * 50)


def replay(seed: int) -> tuple[list[str], float]:
    """The same game played directly on pyspiel: prompts seen and the final return."""
    state, rng = openspiel_server.new_game(seed)
    prompts = []
    while not state.is_terminal():
        prompts.append(render_state(true_state(state)))
        state.apply_action(0 if threshold(prompts[-1]) == "HIT" else 1)
        openspiel_server.play_chance(state, rng)
    return prompts, float(state.returns()[0])


def test_adapter_plays_full_blackjack_games_against_an_openenv_server(openspiel_url):
    pool = EnvPool(EnvConfig(), registry.get("openenv").setup({"url": openspiel_url,
        "codec": "openspiel_blackjack", "concurrency": 4}))
    assert pool.action_words == ("HIT", "STICK")
    seeds = list(range(100, 164))
    prompts = [[start.observation] for start in pool.reset(0, seeds)]
    rewards, active = [0.0] * len(seeds), list(range(len(seeds)))
    while active:
        results = pool.step(0, active, [threshold(prompts[i][-1]) for i in active])
        for slot, result in zip(active, results):
            assert "error" not in result.info, result.info
            rewards[slot] += result.reward
            if not result.done:
                prompts[slot].append(result.observation)
        active = [slot for slot, result in zip(active, results) if not result.done]
    for slot, seed in enumerate(seeds):
        assert (prompts[slot], rewards[slot]) == replay(seed), seed
    assert max(len(p) for p in prompts) >= 3  # games of several decisions, over one socket each
    assert {-1.0, 1.0} <= set(rewards)
    pool.close()


def test_adapter_penalises_text_that_is_no_action_and_plays_on(openspiel_url):
    env = OpenEnvTextEnv(OpenEnvOptions(url=openspiel_url, codec="openspiel_blackjack"), invalid_action_penalty=-1.0)
    env.reset(7)
    result = env.step("I think I will dance")
    assert (result.reward, result.done, result.info["error"]) == (-1.0, True, "invalid action")
    assert env.reset(7) == replay(7)[0][0]  # the same session deals again
    env.close()


def test_unreachable_or_silent_servers_fail_fast_and_clearly():
    env = OpenEnvTextEnv(OpenEnvOptions(url=f"http://127.0.0.1:{free_port()}", codec="openspiel_blackjack",
                                        connect_timeout_s=2), invalid_action_penalty=-1.0)
    with pytest.raises(OpenEnvError, match="reset failed"):
        env.reset(0)
    with socket.socket() as silent:  # accepts connections, never answers the handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = OpenEnvTextEnv(OpenEnvOptions(url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                                            codec="openspiel_blackjack", connect_timeout_s=1, message_timeout_s=1),
                             invalid_action_penalty=-1.0)
        start = time.monotonic()
        with pytest.raises(OpenEnvError, match="127.0.0.1"):
            env.reset(0)
        assert time.monotonic() - start < 10
    with pytest.raises(ConfigError, match="env.options.openenv: url is empty"):
        registry.get("openenv").setup({})
    with pytest.raises(ConfigError, match="env.options.openenv.codec: 'chess' is not one of"):
        registry.get("openenv").setup({"url": "http://127.0.0.1:1", "codec": "chess"})
    with pytest.raises(ConfigError, match="no env named 'chess'"):
        registry.setup(EnvConfig(name="openenv", options={"openenv": {"url": "http://127.0.0.1:1", "kind": "chess"}}))
    with pytest.raises(ConfigError, match="plays no games of its own"):
        registry.setup(EnvConfig(name="openenv", options={"openenv": {"url": "http://127.0.0.1:1", "kind": "openenv"}}))
    # What the server plays is evaluated as that env, with that env's own options.
    played = registry.setup(EnvConfig(name="openenv", options={"openenv": {"url": "http://127.0.0.1:1"},
                                                               "blackjack": {"mc_games": 7}}))
    assert played.played.options.mc_games == 7 and played.probe_prompts()[0].endswith("HIT or STICK?")


def test_a_server_dying_mid_game_ends_that_game_with_a_reason():
    with serving("tests/openspiel_server.py") as (url, proc):
        pool = EnvPool(EnvConfig(), registry.get("openenv").setup({"url": url, "codec": "openspiel_blackjack",
            "message_timeout_s": 5}))
        pool.reset(0, [1, 2])
        proc.kill()
        proc.wait(timeout=10)
        results = pool.step(0, [0, 1], ["STICK", "STICK"])
    for result in results:
        assert result.done and result.reward == -1.0
        assert "OpenEnv server" in result.info["error"] and "step failed" in result.info["error"]


# -- (b) ray_forge envs served over OpenEnv, driven by OpenEnv's own client ---------------------

def test_openenv_client_plays_served_blackjack_exactly_like_the_local_env(blackjack_url):
    from openenv.core import GenericEnvClient

    local = BlackjackTextEnv()
    with GenericEnvClient(base_url=blackjack_url).sync() as client, \
            GenericEnvClient(base_url=blackjack_url).sync() as other:
        for seed in range(40):
            first = client.reset(seed=seed)
            other.reset(seed=seed + 1000)  # a second session mid-episode must not disturb this one
            assert first.observation["text"] == local.reset(seed)
            assert first.observation["action_words"] == ["HIT", "STICK"]
            result = first
            while not result.done:
                action = threshold(result.observation["text"])
                result = client.step({"text": action})
                expected = local.step(action)
                assert (result.observation["text"], result.reward, result.done) == \
                       (expected.observation, expected.reward, expected.done)
        garbage = (client.reset(seed=1), client.step({"text": "no idea"}))[1]
        assert garbage.done and garbage.reward == -1.0 and garbage.observation["error"] == "invalid action"
        state = client.state()
        assert state["env"] == "blackjack" and state["seed"] == 1 and state["step_count"] == 1


def test_adapter_text_codec_round_trips_a_served_env(blackjack_url):
    """ray_forge's adapter, on a ray_forge env served over OpenEnv, gives the local env's games."""
    remote = EnvPool(EnvConfig(), registry.get("openenv").setup({"url": blackjack_url, "codec": "text",
        "concurrency": 2}))
    local = EnvPool(EnvConfig(), registry.get("blackjack").setup({}))
    assert remote.action_words == local.action_words == ("HIT", "STICK")
    seeds = list(range(16))
    assert remote.reset(0, seeds) == local.reset(0, seeds)
    actions = ["HIT", "STICK", "garbage", "HIT"] * 4
    assert remote.step(0, list(range(16)), actions) == local.step(0, list(range(16)), actions)
    remote.close()


def test_openenv_client_runs_code_in_the_served_code_env():
    from openenv.core import GenericEnvClient

    from envs.code.tasks import BUNDLED, load_tasks

    seed = [t.id for t in load_tasks(BUNDLED)].index("gcd")
    with serving("-m", "envs.openenv_server", "--env", "code", "limits.wall_s=2") as (url, _), \
            GenericEnvClient(base_url=url).sync() as client:
        prompt = client.reset(seed=seed).observation
        assert "gcd" in prompt["text"] and prompt["action_words"] is None
        solved = client.step({"text": "```python\nimport math\ndef gcd(a, b):\n    return math.gcd(a, b)\n```"})
        assert solved.done and solved.reward == 1.0 and solved.observation["info"]["task"] == "gcd"
        client.reset(seed=seed)
        stuck = client.step({"text": "```python\nwhile True:\n    pass\n```"})
        assert stuck.done and stuck.reward == 0.0 and stuck.observation["error"].startswith("timeout")
        client.reset(seed=seed)
        assert client.step({"text": "def gcd(a, b):\n    return a if b == 0 else gcd(b, a % b)"}).reward == 1.0


# -- the GRPO job, trained against OpenSpiel BlackJack over OpenEnv -------------------------------

@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_grpo_job_trains_against_an_openenv_server(openspiel_url, ray_cluster, tmp_path):
    from jobs import grpo

    summary = grpo.main(["--config", str(ROOT / "jobs/configs/blackjack_tiny.yaml"), f"run.output_dir={tmp_path}",
                         "env.name=openenv", f"env.options.openenv.url={openspiel_url}",
                         "env.options.openenv.codec=openspiel_blackjack",
                         "run.steps=2", "run.eval_every=2", "env.options.blackjack.mc_games=200",
                             "grpo.prompts_per_step=8",
                         "run.progress=false", "model.tiny.num_layers=2", "cluster.include_dashboard=false",
                         "policy.kv_cache_mb=64"])
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # every game was played to its end on the server, none lost to errors
        assert row["num_games"] == 64 and row["env_errors"] == 0
        assert -1.0 <= row["train_reward"] <= 1.0
    assert summary["policy_versions"] == [3, 3]  # 2 steps, then the demo config's average (trainer.ema_decay)
    assert -1.0 <= summary["exact_return"] <= 1.0  # the same greedy evaluation as local BlackJack

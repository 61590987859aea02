"""OpenSpiel's BlackJack served over OpenEnv, as OpenEnv's ``openspiel_env`` serves it.

OpenEnv ships that env only as a Docker image or a Hugging Face Space, neither reachable here,
so this stands in for it: the real OpenSpiel game (``pyspiel``) behind the real OpenEnv server
(``create_app``), speaking the same ``OpenSpielAction``/``OpenSpielObservation`` JSON. One
difference: ``reset(seed=...)`` deals reproducibly (OpenEnv's ignores the seed), so tests can
replay a game.

    python tests/openspiel_server.py --port 8000
"""

from __future__ import annotations

import argparse
import secrets
from typing import Any

import numpy as np
import pyspiel
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

GAME = "blackjack"
PLAYER = 0


class OpenSpielAction(Action):
    action_id: int
    game_name: str = GAME
    game_params: dict[str, Any] = Field(default_factory=dict)


class OpenSpielObservation(Observation):
    info_state: list[float]
    legal_actions: list[int]
    game_phase: str = "playing"
    current_player_id: int = 0
    opponent_last_action: int | None = None


def play_chance(state: pyspiel.State, rng: np.random.Generator) -> None:
    """Deal cards until a player has to decide (or the game is over)."""
    while state.is_chance_node():
        outcomes, probs = zip(*state.chance_outcomes())
        state.apply_action(int(rng.choice(outcomes, p=probs)))


def new_game(seed: int) -> tuple[pyspiel.State, np.random.Generator]:
    rng = np.random.default_rng(seed)
    state = pyspiel.load_game(GAME).new_initial_state()
    play_chance(state, rng)
    return state, rng


class OpenSpielBlackjack(Environment[OpenSpielAction, OpenSpielObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._game_state: pyspiel.State | None = None
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> OpenSpielObservation:
        self._game_state, self._rng = new_game(secrets.randbelow(2**31) if seed is None else seed)
        self._state = State(episode_id=episode_id or secrets.token_hex(8))
        return self._observation(phase="initial")

    def step(self, action: OpenSpielAction, timeout_s: float | None = None, **kwargs: Any) -> OpenSpielObservation:
        if self._game_state is None or self._game_state.is_terminal():
            raise RuntimeError("no game in progress: reset first")
        if action.action_id not in self._game_state.legal_actions():
            raise ValueError(f"illegal action {action.action_id}")
        self._game_state.apply_action(action.action_id)
        play_chance(self._game_state, self._rng)
        self._state.step_count += 1
        return self._observation(phase="terminal" if self._game_state.is_terminal() else "playing")

    def _observation(self, phase: str) -> OpenSpielObservation:
        game = self._game_state
        done = game.is_terminal()
        return OpenSpielObservation(
            info_state=list(game.observation_tensor(PLAYER)),
            legal_actions=[] if done else game.legal_actions(PLAYER),
            game_phase=phase, current_player_id=game.current_player(), done=done,
            reward=float(game.returns()[PLAYER]) if done else 0.0)

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app(OpenSpielBlackjack, OpenSpielAction, OpenSpielObservation, env_name="openspiel_env",
                     max_concurrent_envs=256)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""What the fleet counts since the run began: restarts, games replayed, chaos kills, nodes lost;
carried across a resume (``state_dict``, ``load_state_dict``)."""

from __future__ import annotations

import logging

from ray_forge.cluster import nodes
from ray_forge.identity import ActorId

log = logging.getLogger(__name__)

CARRIED = ("actor_restarts", "replayed_games", "chaos_kills", "nodes_lost")
"""Counts since the run began, carried across a resume (``Counters.load_state_dict``)."""


class Counters:
    def __init__(self) -> None:
        self.restarts = 0
        """New processes, met by the fleet's calls or its roll call (two of one member between two
        roll calls count once)."""
        self.replayed_games = 0
        self.chaos_kills: list[ActorId] = []
        """Members killed on purpose (``ray_forge/run/chaos.py``)."""
        self.plays_done = 0
        """Chunks played to the end: the chaos monkey waits for one between its kills."""
        self.carried: dict[str, int] = {}
        """``CARRIED`` counts from before a resume."""
        self.nodes_seen: dict[str, str] = {}
        """Every node seen alive since the run began: its id and where it was (address, pool)."""
        self.nodes_lost: set[str] = set()

    def restarted(self) -> None:
        self.restarts += 1

    def replayed(self, games: int) -> None:
        self.replayed_games += games

    def killed(self, name: ActorId) -> None:
        self.chaos_kills.append(name)

    def played(self) -> None:
        self.plays_done += 1

    def state_dict(self) -> dict[str, int]:
        """The ``CARRIED`` counts since the run began, those from before a resume added."""
        since_start = dict(actor_restarts=self.restarts, replayed_games=self.replayed_games,
                           chaos_kills=len(self.chaos_kills), nodes_lost=self.count_lost_nodes())
        return {k: v + self.carried.get(k, 0) for k, v in since_start.items()}

    def load_state_dict(self, counts: dict[str, int]) -> None:
        """Counts from before a resume (a checkpoint's ``state_dict``): added to those from now on. A
        checkpoint written before the counts sat at the top of the driver's state holds them under ``counts``."""
        counts = counts.get("counts", counts)
        self.carried = {key: counts[key] for key in CARRIED}

    def count_lost_nodes(self) -> int:
        """Nodes of the cluster seen alive since the run began and dead now (a lost pod, a preempted
        VM): each is logged once, with where it was."""
        alive, dead = nodes.census()
        for node_id, where in alive.items():
            self.nodes_seen.setdefault(node_id, where)
        for node_id in dead:
            if node_id in self.nodes_seen and node_id not in self.nodes_lost:
                self.nodes_lost.add(node_id)
                log.error("node %s at %s was lost: its actors restart elsewhere or wait for a node to replace it",
                          node_id[:8], self.nodes_seen[node_id])
        return len(self.nodes_lost)

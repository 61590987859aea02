"""Off-policy replay buffer: scored GRPO groups, tagged with the policy version that made them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import ray

from ray_forge.episode import Episode


@dataclass
class _Entry:
    group: list[Episode]
    uses: int = 0

    @property
    def policy_version(self) -> int:
        return min(e.policy_version for e in self.group)


class ReplayBuffer:
    """FIFO of whole groups (advantages compare games within a group, so groups stay intact).

    A group is evicted once it is more than ``max_policy_lag`` versions behind the trainer,
    after ``max_uses`` hand-outs, or when ``capacity_games`` is exceeded (oldest first).
    """

    def __init__(self, *, max_policy_lag: int, max_uses: int = 1, capacity_games: int = 65536) -> None:
        if max_uses < 1:
            raise ValueError("max_uses must be >= 1")
        self.max_policy_lag = max_policy_lag
        self.max_uses = max_uses
        self.capacity_games = capacity_games
        self._entries: deque[_Entry] = deque()
        self.num_evicted_stale = 0
        self.num_dropped_full = 0

    def add(self, groups: list[list[Episode]]) -> int:
        for group in groups:
            self._entries.append(_Entry(list(group)))
        while self.num_games() > self.capacity_games:
            self._entries.popleft()
            self.num_dropped_full += 1
        return self.num_games()

    def evict_stale(self, trainer_version: int) -> int:
        """Drop groups older than ``trainer_version - max_policy_lag``; returns how many."""
        oldest_allowed = trainer_version - self.max_policy_lag
        before = len(self._entries)
        self._entries = deque(e for e in self._entries if e.policy_version >= oldest_allowed)
        evicted = before - len(self._entries)
        self.num_evicted_stale += evicted
        return evicted

    def sample(self, num_games: int, trainer_version: int) -> list[list[Episode]] | None:
        """Oldest fresh groups totalling ``num_games`` games, or None if there are not enough yet."""
        self.evict_stale(trainer_version)
        if self.num_games() < num_games:
            return None
        batch, taken = [], 0
        for entry in list(self._entries):
            if taken >= num_games:
                break
            batch.append(entry.group)
            taken += len(entry.group)
            entry.uses += 1
            if entry.uses >= self.max_uses:
                self._entries.remove(entry)
        return batch

    def num_games(self) -> int:
        return sum(len(e.group) for e in self._entries)

    def stats(self) -> dict[str, int]:
        return dict(buffer_games=self.num_games(), evicted_stale=self.num_evicted_stale,
                    dropped_full=self.num_dropped_full)


BufferActor = ray.remote(ReplayBuffer)

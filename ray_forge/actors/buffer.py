"""Off-policy replay buffer: scored GRPO groups, tagged with the policy version that made them.

It also keeps the run's game accounting, because every game passes through it exactly once:
generated = trained + evicted as stale + dropped (no signal, or over capacity) + still buffered.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from ray_forge.config.schema import BufferConfig
from ray_forge.core.algorithm import Baseline, RewardScale, group_advantages
from ray_forge.core.batch import groups_to_samples
from ray_forge.core.checkpoint import BUFFER_STATE
from ray_forge.core.episode import Episode
from ray_forge.remote import SMALL_CALL_S, Pickled, call

COUNTERS = ("generated", "trained", "evicted_stale", "dropped_no_signal", "dropped_full")
"""Cumulative game counts, in the order of the identity above."""

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    group: list[Episode]
    uses: int = 0

    @property
    def policy_version(self) -> int:
        return min(e.policy_version for e in self.group)


def has_signal(group: list[Episode]) -> bool:
    """The same test as the trainer's advantages: a group whose rewards are all equal teaches nothing."""
    _, keep = group_advantages(torch.tensor([e.reward for e in group]), group_size=len(group))
    return bool(keep[0])


class ReplayBuffer:
    """FIFO of whole groups (advantages compare games within a group, so groups stay intact).

    A group is evicted once it is more than ``max_policy_lag`` versions behind the trainer,
    after ``max_uses`` hand-outs, or when ``capacity_games`` is exceeded (oldest first).
    ``next_batch`` is the rollout's position: the first batch not yet added, saved with the
    contents so that a resumed run neither replays nor skips a batch.

    Rollout workers add a batch in chunks (``add_chunk``), each as soon as it is played; a batch
    enters whole, and in order, once all its chunks are in. Chunks of unfinished batches are not
    part of a checkpoint (a resumed run plays those batches again), and a chunk added twice (a
    worker that died after adding it, replayed) counts once.
    """

    def __init__(self, config: BufferConfig) -> None:
        self.max_policy_lag = config.max_policy_lag
        self.max_uses = config.max_uses
        self.capacity_games = config.capacity_games
        self._entries: deque[_Entry] = deque()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.next_batch = 0
        self._chunks: dict[int, dict[int, list[list[Episode]]]] = {}
        self._num_chunks: dict[int, int] = {}
        self._added = asyncio.Event()
        """Set whenever games come in: ``wait_batch`` waits on it."""

    def add(self, groups: list[list[Episode]], next_batch: int | None = None) -> int:
        for group in groups:
            self._entries.append(_Entry(list(group)))
            self.counts["generated"] += len(group)
        if next_batch is not None:
            self.next_batch = next_batch
        while self.num_games() > self.capacity_games:
            self.counts["dropped_full"] += len(self._entries.popleft().group)
        self._added.set()
        return self.num_games()

    def add_chunk(self, batch: int, chunk: int, num_chunks: int,
                  groups: list[list[Episode]] | Pickled[list[list[Episode]]]) -> int:
        """Chunk ``chunk`` of ``num_chunks`` of batch ``batch``; complete batches enter in order."""
        if isinstance(groups, Pickled):  # what rollout workers send (see ``Pickled``)
            groups = groups.get()
        if batch >= self.next_batch:
            self._chunks.setdefault(batch, {})[chunk] = groups
            self._num_chunks[batch] = num_chunks
        while len(self._chunks.get(self.next_batch, ())) == self._num_chunks.get(self.next_batch, -1):
            done = self._chunks.pop(self.next_batch)
            del self._num_chunks[self.next_batch]
            self.add([g for c in sorted(done) for g in done[c]], self.next_batch + 1)
        return self.num_games()

    def sample_batch(self, num_games: int, trainer_version: int, merge: bool, scale: RewardScale = "group",
                     baseline: Baseline = "group") -> tuple[dict, ray.ObjectRef] | None:
        """``sample``'s groups made into training samples, here beside the games: (the batch's
        statistics, a reference to the samples in the object store), or None. The trainer ranks
        (and the reference model) fetch the samples themselves; the caller holds only the reference."""
        groups = self.sample(num_games, trainer_version, baseline)
        if groups is None:
            return None
        samples, stats = groups_to_samples(groups, merge, trainer_version, scale, baseline)
        return stats, ray.put(samples)

    async def wait_batch(self, num_games: int, trainer_version: int, merge: bool, timeout_s: float,
                         scale: RewardScale = "group", baseline: Baseline = "group") -> tuple[dict, ray.ObjectRef] | None:
        """``sample_batch``, waiting up to ``timeout_s`` for enough games to come in; None if they did not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (batch := self.sample_batch(num_games, trainer_version, merge, scale, baseline)) is None:
            self._added.clear()
            try:
                await asyncio.wait_for(self._added.wait(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return None
        return batch

    def evict_stale(self, trainer_version: int) -> int:
        """Drop groups older than ``trainer_version - max_policy_lag``; returns how many."""
        oldest_allowed = trainer_version - self.max_policy_lag
        stale = [e for e in self._entries if e.policy_version < oldest_allowed]
        self._entries = deque(e for e in self._entries if e.policy_version >= oldest_allowed)
        self.counts["evicted_stale"] += sum(len(e.group) for e in stale)
        return len(stale)

    def sample(self, num_games: int, trainer_version: int, baseline: Baseline = "group") -> list[list[Episode]] | None:
        """Oldest fresh groups totalling ``num_games`` games, or None if there are not enough yet.
        A group used up counts as dropped for want of signal only under the "group" baseline,
        which drops a group whose games all scored alike (under "prompt" its turns may still differ
        from other turns of their prompts)."""
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
                trained = baseline == "prompt" or has_signal(entry.group)
                self.counts["trained" if trained else "dropped_no_signal"] += len(entry.group)
        return batch

    def num_games(self) -> int:
        return sum(len(e.group) for e in self._entries)

    def stats(self) -> dict[str, int]:
        """Cumulative game counts and the games still buffered (``buffer_size``); logs an error
        if they break the identity of the module's docstring (a game lost or counted twice)."""
        row = dict(self.counts, buffer_size=self.num_games())
        accounted = sum(row[k] for k in COUNTERS[1:]) + row["buffer_size"]
        if accounted != row["generated"]:
            log.error("game accounting is off: %d generated, %d accounted for (%s)", row["generated"], accounted, row)
        return row

    def state(self) -> dict:
        """Everything a checkpoint needs, taken in one call (the actor runs calls one at a time)."""
        return dict(entries=[(e.group, e.uses) for e in self._entries], counts=dict(self.counts),
                    next_batch=self.next_batch)

    def save(self, path: str) -> dict[str, int]:
        """``state()`` into the file ``path`` (in a checkpoint being written); returns what the
        driver keeps of it: the rollout position and the games buffered."""
        with open(path, "wb") as f:
            pickle.dump(self.state(), f, protocol=pickle.HIGHEST_PROTOCOL)
        return dict(next_batch=self.next_batch, games=self.num_games())

    def load(self, path: str) -> int:
        """The state ``save`` wrote (a checkpoint verified against its manifest); returns the games buffered."""
        with open(path, "rb") as f:
            return self.load_state(pickle.load(f))

    def load_state(self, state: dict) -> int:
        self._entries = deque(_Entry(list(group), uses) for group, uses in state["entries"])
        self.counts = dict(state["counts"])
        self.next_batch = state["next_batch"]
        return self.num_games()


BufferActor = ray.remote(ReplayBuffer)


class BufferFiles:
    """The buffer as a part of the run's checkpoints (``core.checkpoint.Writer``): it writes its
    games into the checkpoint itself, and the driver keeps its rollout position."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer

    def files(self) -> list[str]:
        return [BUFFER_STATE]

    async def save(self, folder: Path) -> dict[str, int]:
        return await call(self.buffer.save.remote(str(folder / BUFFER_STATE)), timeout_s=SMALL_CALL_S,
                          what="buffer.save")

    async def load(self, folder: Path, saved: dict[str, int], step: int) -> None:
        games = await call(self.buffer.load.remote(str(folder / BUFFER_STATE)), timeout_s=SMALL_CALL_S,
                           what="buffer.load")
        # Loaded after the trainer, which checked that its weights are the step's version.
        log.info("resumed %s from %s: step %d, policy version %d, %d games buffered, next batch %d",
                 folder.parent.parent, folder.name, step, step, games, saved["next_batch"])

"""Drives the trainer ranks as one: fan a batch out, combine their statistics, export weights."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ray

from ray_forge.cluster import nodes
from ray_forge.core.algorithm import TOKEN_STATS as _TOKEN_WEIGHTED
from ray_forge.core.checkpoint import DCP_METADATA, CheckpointError, rank_file
from ray_forge.core.episode import Sample
from ray_forge.identity import trainer
from ray_forge.remote import SHUTDOWN_S, SMALL_CALL_S, RemoteCallError, call, get, last_line
from ray_forge.weights import StoreSpec, SyncNotOpened, WeightSyncError

log = logging.getLogger(__name__)


WATCH_S = 5.0
"""How often a run asks its trainer ranks whether they are alive."""


class TrainerGroup:
    """Takes the rank actor handles (rank 0 first) as parameters; holds no model itself."""

    def __init__(self, ranks: list, timeout_s: float) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.nodes: list[str] = []
        """The node id of each rank (once ``setup`` ran): a dead rank's error names its node."""

    def setup(self) -> int:
        """Rendezvous at rank 0's address and shard the model; returns the parameter count."""
        addr, port = get(self.ranks[0].rendezvous_address.remote(), timeout_s=SMALL_CALL_S, what="rendezvous_address",
                         actor=trainer(0))
        counts = get([r.setup.remote(addr, port) for r in self.ranks], timeout_s=self.timeout_s, what="trainer.setup")
        self.nodes = get([r.node_id.remote() for r in self.ranks], timeout_s=SMALL_CALL_S, what="trainer ranks' nodes")
        return counts[0]

    async def train_step(self, samples: list[Sample] | ray.ObjectRef,
                         ref_logprobs: list | ray.ObjectRef | None = None) -> dict[str, float]:
        """Every rank sees the whole batch and trains on its share of rows. Either argument may be
        an object reference (the buffer's samples, the reference model's answer): each rank
        fetches it from the object store itself."""
        per_rank = await self._all("train_step", lambda rank: (samples, ref_logprobs))
        return combine_rank_stats(per_rank)

    async def sft_step(self, rows: list | ray.ObjectRef) -> dict[str, float]:
        """One supervised step on packed rows (``TitanTrainer.sft_step``): the loss is the sum of
        the ranks' shares; the rest is the same on every rank."""
        per_rank = await self._all("sft_step", lambda rank: (rows,))
        return dict(per_rank[0], loss=sum(s["loss"] for s in per_rank))

    async def sft_eval(self, rows: list | ray.ObjectRef) -> float:
        """The supervised loss of ``rows`` with no update (every rank takes its share)."""
        return sum(await self._all("sft_eval", lambda rank: (rows,)))

    async def export_hf(self, out_dir: str) -> str:
        """All ranks gather the full weights; rank 0 writes them."""
        paths = await self._all("export_hf", lambda rank: (out_dir if rank == 0 else None,))
        return paths[0]

    async def use_average(self) -> None:
        """Every rank's weights become their moving average (``trainer.ema_decay``)."""
        await self._all("use_average", lambda rank: ())

    async def publish_weights(self, spec: StoreSpec, version: int) -> float:
        """Every rank puts its own shards (none gathers the model); the version is published once
        all have. Returns the slowest rank's seconds. The driver runs this together with the
        engines' sync (``Fleet.sync``): over some transports the ranks stream into the engines.

        A sync that fails is not the trainer's failure: it is logged, the engines keep their
        version, and the next sync tries again. A rank that dies is, and so is a publish no driver
        opened a sync for (a driver that did not run the two together)."""
        refs = [r.publish_weights.remote(spec, version) for r in self.ranks]
        results = await asyncio.gather(*(self._call(ref, "publish_weights", i) for i, ref in enumerate(refs)),
                                       return_exceptions=True)
        seconds = []
        for rank, result in enumerate(results):
            cause = getattr(result, "cause", None)
            if isinstance(result, ray.exceptions.RayTaskError) and isinstance(cause, WeightSyncError) \
                    and not isinstance(cause, SyncNotOpened):
                log.warning("%s: %s", trainer(rank), cause)
            elif isinstance(result, BaseException):
                raise result
            else:
                seconds.append(result)
        return max(seconds, default=0.0)

    async def score(self, pairs: list) -> list:
        """Every rank scores the same (prompt, response) pairs; rank 0's answer (see ``TitanTrainer.score``)."""
        return (await self._all("score", lambda rank: (pairs,)))[0]

    # -- as a part of the run's checkpoints (``core.checkpoint.Writer``) --------------------------
    def files(self) -> list[str]:
        return [DCP_METADATA] + [rank_file(rank) for rank in range(len(self.ranks))]

    async def save(self, folder: Path) -> None:
        try:
            await self.save_checkpoint(str(folder))
        except ray.exceptions.RayTaskError as err:  # a rank could not write its shards (a full disk, ...)
            raise CheckpointError(last_line(err)) from None

    async def load(self, folder: Path, saved: None, step: int) -> None:
        try:
            version = await self.load_checkpoint(str(folder))
        except ray.exceptions.RayTaskError as err:
            raise CheckpointError(f"{folder} could not be loaded: {last_line(err)}; move it aside to resume "
                                  "from the one before") from None
        if version != step:
            raise CheckpointError(f"{folder}: the trainer's shards are at version {version}, the driver's state "
                                  f"at step {step}")

    async def save_checkpoint(self, folder: str) -> float:
        """Every rank writes its shards into ``folder``; returns the slowest rank's seconds."""
        return max(await self._all("save_checkpoint", lambda rank: (folder,)))

    async def load_checkpoint(self, folder: str) -> int:
        """Every rank restores its shards; returns the restored version."""
        return (await self._all("load_checkpoint", lambda rank: (folder,)))[0]

    async def watch(self, every_s: float = WATCH_S) -> None:
        """Until cancelled: each rank answers every ``every_s`` (after whatever it is running). A
        dead rank raises, naming its node, so a run that is waiting for rollouts stops on a lost
        trainer node at once, not when it next asks the trainer for something. A rank slow to
        answer (behind a long checkpoint) is not an error here: its own calls have timeouts."""
        while True:
            try:
                await self._all("node_id", lambda rank: ())
            except RemoteCallError as err:
                if err.died:
                    raise
            await asyncio.sleep(every_s)

    async def _all(self, method: str, args_for_rank) -> list:
        refs = [getattr(r, method).remote(*args_for_rank(i)) for i, r in enumerate(self.ranks)]
        return await asyncio.gather(*(self._call(ref, method, i) for i, ref in enumerate(refs)))

    async def _call(self, ref, method: str, rank: int):
        """A rank's answer; a dead rank's error says which node it ran on, and that the node is lost
        once Ray has declared it dead (the run stops on it: the message is the job's last line)."""
        try:
            return await call(ref, timeout_s=self.timeout_s, what=method, actor=trainer(rank))
        except RemoteCallError as err:
            if not err.died or rank >= len(self.nodes):
                raise
            node = nodes.find(self.nodes[rank])
            state = await asyncio.to_thread(nodes.state, node)
            where = f"{node.get('NodeManagerAddress', '?')} ({self.nodes[rank][:8]}{state})"
            raise RemoteCallError(f"{err}, on node {where}", err.what, died=True, actor=err.actor) from err

    def shutdown(self) -> None:
        try:
            get([r.shutdown.remote() for r in self.ranks], timeout_s=SHUTDOWN_S, what="trainer.shutdown")
        except Exception:  # a dead rank cannot be shut down politely; the actor is killed anyway
            pass


def combine_rank_stats(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Loss shares and forwarded rows add up (each rank divides by the global normaliser); other statistics are
    token-weighted means; grad norm, lr, version and a skipped update are the same on every rank."""
    num_tokens = sum(s["num_tokens"] for s in per_rank) or 1.0
    stats = {k: sum(s[k] for s in per_rank) / num_tokens for k in _TOKEN_WEIGHTED}
    stats.update(loss=sum(s["loss"] for s in per_rank), num_tokens=num_tokens,
                 forward_rows=sum(s.get("forward_rows", 0.0) for s in per_rank),
                 grad_norm=per_rank[0]["grad_norm"], lr=per_rank[0]["lr"], version=per_rank[0]["version"],
                 skipped_nonfinite=per_rank[0]["skipped_nonfinite"])
    return stats

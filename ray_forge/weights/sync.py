"""The driver's side of a weight sync: *sync version N to these engines*.

Every transport runs the same round. The driver opens it for the engines that are live, runs the
trainer ranks' publish and every engine's ``update_weights`` at the same time (an engine waits,
off its step loop, until the version reaches it), tells the round when an engine dies, and closes
it. What opening and a death mean is the transport's business: nothing for a transport that
stores versions (an engine that missed one loads it when it is back); for one that pushes into
live engines, who takes part, and an abort that frees the others at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_forge.weights.base import StoreSpec, WeightSyncError
from ray_forge.weights.controller import ControllerClient
from ray_forge.weights.rendezvous import Session

ENGINE_GRACE_S = 60.0
"""Beyond the transfer's own timeout, how long the driver waits for an engine's answer: a sync
bounds its waits by ``spec.timeout_s`` and names the peer it waited for; leave it room to say so."""


@dataclass
class SyncRound:
    """One version on its way from the trainer ranks to the live engines."""

    spec: StoreSpec
    version: int
    engines: tuple[int, ...]
    """Indices (into ``spec.receivers``) of the engines the round was opened for."""
    session: Session | None = None

    @classmethod
    async def open(cls, spec: StoreSpec, version: int, engines: list[int], again: bool = False) -> "SyncRound":
        """``again``: engines an earlier round of ``version`` left behind fetch it once more, from the
        store; a push is sent once and kept nowhere, so it cannot be."""
        if again and spec.pushes:
            raise WeightSyncError(f"weights version {version} was pushed ({spec.transport}), and a push is kept "
                                  "nowhere to fetch again")
        sync = cls(spec, version, tuple(engines))
        if spec.pushes:
            if len(spec.receivers) <= max(engines, default=-1):
                raise ValueError(f"engine {max(engines)} is not one of the weight store's receivers "
                                 f"{list(spec.receivers)}")
            members = tuple(spec.receivers[i] for i in engines)
            sync.session = await ControllerClient(spec).ask_async("open_push", version, members, spec)
        return sync

    @property
    def engine_timeout_s(self) -> float:
        return self.spec.timeout_s + ENGINE_GRACE_S

    async def engine_died(self, engine: str, reason: str) -> None:
        """An engine of the round died: peers streaming into it stop waiting for it."""
        if self.session is not None:
            await ControllerClient(self.spec).ask_async("push_failed", self.session.generation,
                                                        f"{engine} died ({reason})"[:2000])

    async def close(self) -> None:
        """The round is over: an engine asking for this version now missed it."""
        if self.session is not None:
            await ControllerClient(self.spec).ask_async("close_push", self.version)

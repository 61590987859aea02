"""The driver's calls in flight to each fleet member: cancelled when the member goes down."""

from __future__ import annotations

import ray

from ray_forge.identity import ActorId
from ray_forge.remote import RemoteCallError, call


class Calls:
    def __init__(self) -> None:
        self.in_flight: dict[ActorId, set[ray.ObjectRef]] = {}

    async def call(self, name: ActorId, ref: ray.ObjectRef, *, timeout_s: float, what: str):
        """The answer to a call of the driver's to member ``name``: kept in ``in_flight`` while in
        flight, and cancelled when it is not answered in time (it would stay queued by Ray
        behind a restart)."""
        self.in_flight.setdefault(name, set()).add(ref)
        try:
            return await call(ref, timeout_s=timeout_s, what=what, actor=name)
        except RemoteCallError as err:
            if not err.died:
                ray.cancel(ref)
            raise
        finally:
            self.in_flight.get(name, set()).discard(ref)

    def cancel(self, name: ActorId) -> None:
        """Cancel the calls in flight to ``name``, which died: queued behind a restart that may never
        come, they would wait for it."""
        for ref in self.in_flight.pop(name, set()):
            ray.cancel(ref)

"""Every remote wait has a timeout, and a failure names the actor and the call."""

from __future__ import annotations

import asyncio
from typing import Any

import ray


class ActorRestarted(RuntimeError):
    """Raised by an actor asked about state it lost when Ray restarted it (a batch it never
    dealt); a caller treats it like the actor's death."""


class RemoteCallError(RuntimeError):
    """An actor died or did not answer in time. ``actor`` is the name before the call's dot
    (``policy-1`` for ``policy-1.generate``); ``died`` is False for a timeout."""

    def __init__(self, message: str, what: str = "", died: bool = False) -> None:
        super().__init__(message)
        self.what = what
        self.actor = what.split(".")[0]
        self.died = died

    def __reduce__(self):
        # Raised inside a rollout worker, it reaches the driver pickled: keep who died.
        return RemoteCallError, (str(self), self.what, self.died)


async def call(ref: ray.ObjectRef, *, timeout_s: float, what: str) -> Any:
    """Await ``ref``; ``what`` (e.g. 'policy-0.generate') appears in the error."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s", what) from None
    except ray.exceptions.RayActorError as err:
        raise _died(what, err) from err
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, ActorRestarted):
            raise RemoteCallError(f"{what} failed: {err.cause}", what, died=True) from err
        if isinstance(err.cause, RemoteCallError):  # a call the remote actor made failed: name that one
            raise RemoteCallError(f"{what}: {err.cause}", err.cause.what, died=err.cause.died) from err
        raise


async def computed(ref: ray.ObjectRef, *, timeout_s: float, what: str) -> None:
    """Wait until ``ref`` is computed without fetching it here (whoever it is passed on to fetches it)."""
    done, _ = await asyncio.to_thread(ray.wait, [ref], timeout=timeout_s, fetch_local=False)
    if not done:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s", what)


def get(ref: ray.ObjectRef | list[ray.ObjectRef], *, timeout_s: float, what: str) -> Any:
    """Blocking ``ray.get`` with the same error contract as :func:`call`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s", what) from None
    except ray.exceptions.RayActorError as err:
        raise _died(what, err) from err


def _died(what: str, err: Exception) -> RemoteCallError:
    """Name the cause: an actor whose constructor raised ends its message with that error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = lines[-1] if lines and "Error" in lines[-1].split(":")[0] else err.__class__.__name__
    if isinstance(err, ray.exceptions.ActorUnavailableError):  # restarting, or unreachable for a moment
        cause = "unavailable: restarting or unreachable"
    return RemoteCallError(f"{what} failed: the actor died ({cause})", what, died=True)

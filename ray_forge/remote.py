"""Every remote wait has a timeout, and a failure names the actor and the call."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, Generic, TypeVar

import ray

from ray_forge.identity import ActorId


T = TypeVar("T")

SMALL_CALL_S = 60.0
"""Bound on a call that does no model work (who are you, stats, a node id, saving a step's games):
minutes only when a node is lost or overloaded."""
SHUTDOWN_S = 30.0
"""How long an actor has to close politely (engine cores, sessions, process groups) before it is killed."""
REPLY_SLACK_S = 60.0
"""Added to a bound the callee enforces itself (a play limit, a weight fetch), so its own timeout,
with its clearer error, fires first."""


class Pickled(Generic[T]):
    """A value sent between actors as one ``bytes``, pickled by the standard C pickler. Ray pickles
    call arguments with cloudpickle, whose Python hook runs once per object: for a batch's
    thousands of episodes that made the rollout worker's send to the buffer cost more than
    playing the games."""

    __slots__ = ("data",)

    def __init__(self, value: T) -> None:
        self.data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def get(self) -> T:
        return pickle.loads(self.data)


class ActorRestarted(RuntimeError):
    """Raised by an actor asked about state it lost when Ray restarted it (a batch it never
    dealt); a caller treats it like the actor's death."""


class RemoteCallError(RuntimeError):
    """An actor died or did not answer in time. ``actor`` is the fleet member that did (None for
    one outside the fleet: the buffer, the weight store); ``died`` is False for a timeout."""

    def __init__(self, message: str, what: str = "", died: bool = False, actor: ActorId | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.actor = actor
        self.died = died

    def __reduce__(self):
        # Raised inside a rollout worker, it reaches the driver pickled: keep who died.
        return RemoteCallError, (str(self), self.what, self.died, self.actor)


def _label(what: str, actor: ActorId | None) -> str:
    return f"{actor}.{what}" if actor is not None else what


async def call(ref: ray.ObjectRef, *, timeout_s: float, what: str, actor: ActorId | None = None) -> Any:
    """Await ``ref``; the error names the call: ``what`` of ``actor`` ('policy-0.generate'), or
    ``what`` alone for an actor outside the fleet ('buffer.stats')."""
    label = _label(what, actor)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise RemoteCallError(f"{label} did not answer within {timeout_s:.0f}s", label, actor=actor) from None
    except ray.exceptions.RayActorError as err:
        raise _died(label, actor, err) from err
    except ray.exceptions.TaskCancelledError:  # cancelled by the caller's side: its actor went down
        raise RemoteCallError(f"{label} was cancelled: the actor is down", label, died=True, actor=actor) from None
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, ActorRestarted):
            raise RemoteCallError(f"{label} failed: {err.cause}", label, died=True, actor=actor) from err
        if isinstance(err.cause, RemoteCallError):  # a call the remote actor made failed: name that one
            inner = err.cause
            raise RemoteCallError(f"{label}: {inner}", inner.what, died=inner.died, actor=inner.actor) from err
        raise


async def computed(ref: ray.ObjectRef, *, timeout_s: float, what: str) -> None:
    """Wait until ``ref`` is computed without fetching it here (whoever it is passed on to fetches it)."""
    done, _ = await asyncio.to_thread(ray.wait, [ref], timeout=timeout_s, fetch_local=False)
    if not done:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s", what)


def get(ref: ray.ObjectRef | list[ray.ObjectRef], *, timeout_s: float, what: str,
        actor: ActorId | None = None) -> Any:
    """Blocking ``ray.get`` with the same error contract as :func:`call`."""
    label = _label(what, actor)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RemoteCallError(f"{label} did not answer within {timeout_s:.0f}s", label, actor=actor) from None
    except ray.exceptions.RayActorError as err:
        raise _died(label, actor, err) from err


def last_line(err: Exception) -> str:
    """A remote error's own last line: the exception an actor's constructor raised, a rank's
    OSError inside the error DCP wraps it in; the error's class if it has no text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else err.__class__.__name__


def _died(what: str, actor: ActorId | None, err: Exception) -> RemoteCallError:
    """Name the cause: an actor whose constructor raised ends its message with that error."""
    cause = last_line(err)
    if "Error" not in cause.split(":")[0]:
        cause = err.__class__.__name__
    if isinstance(err, ray.exceptions.ActorUnavailableError):  # restarting, or unreachable for a moment
        cause = "unavailable: restarting or unreachable"
    return RemoteCallError(f"{what} failed: the actor died ({cause})", what, died=True, actor=actor)

"""Every remote wait has a timeout, and a failure names the actor and the call."""

from __future__ import annotations

import asyncio
from typing import Any

import ray


class RemoteCallError(RuntimeError):
    """An actor died or did not answer in time."""


async def call(ref: ray.ObjectRef, *, timeout_s: float, what: str) -> Any:
    """Await ``ref``; ``what`` (e.g. 'policy-0.generate') appears in the error."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s") from None
    except ray.exceptions.RayActorError as err:
        raise RemoteCallError(f"{what} failed: the actor died ({err.__class__.__name__})") from err


def get(ref: ray.ObjectRef | list[ray.ObjectRef], *, timeout_s: float, what: str) -> Any:
    """Blocking ``ray.get`` with the same error contract as :func:`call`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RemoteCallError(f"{what} did not answer within {timeout_s:.0f}s") from None
    except ray.exceptions.RayActorError as err:
        raise RemoteCallError(f"{what} failed: the actor died ({err.__class__.__name__})") from err

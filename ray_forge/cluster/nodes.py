"""Ray's nodes as the run asks about them: which are alive, one found by its id, where one is, and
whether it is lost. The only module that reads ``ray.nodes()``.

Ray declares a node dead only after its missed health checks (about 15 s, and far longer while
the GCS is busy), while an actor's death on it reaches the run within a second or two: a node
whose raylet refuses connections (its process is gone) is lost already.
"""

from __future__ import annotations

import socket

import ray

from ray_forge.config.schema import POOL_LABEL

RAYLET_PROBE_S = 2.0
"""How long a node's raylet is given to take a connection before the node is called lost."""


def all_nodes() -> list[dict]:
    """Ray's record of every node it lists (``ray.nodes()``), the dead ones too (this process must
    be connected)."""
    return ray.nodes()


def alive() -> list[dict]:
    """The records of the nodes Ray lists alive."""
    return [node for node in all_nodes() if node["Alive"]]


def find(node_id: str) -> dict:
    """Ray's record of the node; empty when Ray does not list it (or is not running)."""
    return next((n for n in all_nodes() if n["NodeID"] == node_id), {}) if ray.is_initialized() else {}


def address(node: dict) -> str | None:
    """The address of ``node``'s raylet; None for a node Ray does not list."""
    return node.get("NodeManagerAddress")


def alive_address(node_id: str) -> str | None:
    """The address of the node's raylet while Ray lists it alive; None otherwise."""
    node = find(node_id)
    return address(node) if node.get("Alive") else None


def raylets_alive() -> set[tuple[str, int]]:
    """(address, port) of the raylet of each node Ray lists alive."""
    return {(node["NodeManagerAddress"], node["NodeManagerPort"]) for node in alive()}


def pool(node: dict) -> str | None:
    """The pool ``node`` is labelled with (``POOL_LABEL``); None when it has none."""
    return node.get("Labels", {}).get(POOL_LABEL)


def census() -> tuple[dict[str, str], list[str]]:
    """One look at the cluster: each node alive (its id: where it is, address and pool) and the
    ids of the nodes Ray lists dead; nothing when Ray is not running."""
    up, dead = {}, []
    for node in all_nodes() if ray.is_initialized() else ():
        if node["Alive"]:
            up[node["NodeID"]] = f"{address(node)} (pool {pool(node) or 'unlabelled'})"
        else:
            dead.append(node["NodeID"])
    return up, dead


def state(node: dict, timeout_s: float = RAYLET_PROBE_S) -> str:
    """", lost" if Ray has declared ``node`` dead or its raylet refuses connections. A raylet that
    does not answer in time may be lost or only overloaded, and is said so. A node whose raylet
    answers (an actor on it died alone) and one Ray does not list add nothing."""
    if not node:
        return ""
    if not node.get("Alive", True):
        return ", lost"
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return ", lost: its raylet refuses connections"
    except OSError:
        return f", its raylet does not answer within {timeout_s:.0f}s: lost or overloaded"
    return ""


def lost(node_id: str) -> bool:
    """Whether the node is certainly gone, with every process that ran on it."""
    return state(find(node_id)).startswith(", lost")

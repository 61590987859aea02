"""Faults on purpose: kill an env actor or a policy engine about every ``chaos.every_s`` seconds,
and whole nodes at chosen steps (``chaos.kill_nodes``).

An actor's kill is Ray's own (``ray.kill(..., no_restart=False)``): the actor's process dies at
once, whatever it is doing, and Ray restarts it as it would after a crash. The schedule (who, and
the jitter of the interval) is drawn from ``chaos.seed``. A node's kill is a lost pod: its raylet,
object store and workers die together (``LocalCluster.kill_node``), and a node with the same labels
may join later.
"""

from __future__ import annotations

import asyncio
import logging
import random

from ray_forge.cluster import local, nodes
from ray_forge.config import ConfigError
from ray_forge.config.schema import ChaosConfig, NodeKill
from ray_forge.identity import ActorId
from ray_forge.remote import SMALL_CALL_S, get

log = logging.getLogger(__name__)


def victims(config: ChaosConfig, members: list[ActorId]) -> list[ActorId]:
    """The actors the config allows to be killed: a role (``env``) or an actor (``policy-1``)."""
    return [m for m in members if m.matches(config.targets)]


async def chaos_monkey(config: ChaosConfig, fleet, stop: asyncio.Event) -> None:
    """Until ``stop`` is set: wait ``every_s`` (x0.5 to x1.5), kill one allowed actor through the
    fleet (``Fleet.kill``: it counts the kill and waits for the restart). An actor is spared while
    it restarts (Ray says it is not alive yet): killing an engine again before it is up would only
    show that it cannot start. If the drawn one is restarting, another is drawn; if all are, the
    kill waits. A kill also waits until the fleet has played a chunk to its end since the last
    one: on a slow machine the faults come slower, never so fast that no chunk can finish (which
    would only show the machine's speed)."""
    rng = random.Random(config.seed)
    allowed = victims(config, sorted(fleet.members))
    if not allowed:
        raise ValueError(f"chaos.targets {config.targets} match no actor of {[str(m) for m in sorted(fleet.members)]}")
    done_at_kill = -1
    while True:
        if await _stopped(stop, config.every_s * rng.uniform(0.5, 1.5)):
            return
        while fleet.plays_done <= done_at_kill:
            if await _stopped(stop, 0.5):
                return
        name = rng.choice(allowed)
        while fleet.down(name):
            up = [n for n in allowed if not fleet.down(n)]
            if up:
                name = rng.choice(up)
                break
            if await _stopped(stop, 0.5):
                return
        done_at_kill = fleet.plays_done
        log.warning("chaos: killing %s", name)
        await fleet.kill(name)


async def _stopped(stop: asyncio.Event, wait_s: float) -> bool:
    """Whether ``stop`` was set within ``wait_s``."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=wait_s)
        return True
    except asyncio.TimeoutError:
        return False


class NodeChaos:
    """``chaos.kill_nodes``: each node lost once the run has finished its step, and replaced
    after its delay. Checked before the run starts: a name that is no actor, or a cluster this
    process did not start, is a config error then, not a fault that never comes."""

    def __init__(self, kills: tuple[NodeKill, ...], actors: dict[str, object]) -> None:
        self.cluster = local.joined()
        if self.cluster is None:
            raise ConfigError("chaos.kill_nodes kills nodes of a local multi-node cluster that this process started "
                              "and joined (ray_forge.cluster.local.LocalCluster.connect); this run joined another "
                              "cluster, or an embedded one-node cluster")
        for i, kill in enumerate(kills):
            if kill.holding not in actors:
                raise ConfigError(f"chaos.kill_nodes[{i}].holding={kill.holding!r} is no actor of this run "
                                  f"(known: {', '.join(sorted(actors))})")
        self.kills = sorted(kills, key=lambda kill: kill.at_step)
        self.actors = actors

    async def run(self, metrics, stop: asyncio.Event) -> None:
        """Until every kill is done or ``stop`` is set. A step's kill comes once the step is closed
        (``metrics.logged``: its checkpoint saved, if one was due), so a resumed run, which skips the
        kills of the steps it resumes after, never meets one twice. A lost
        node's replacement joins after its delay even if the run is ending meanwhile, as a cloud
        replaces a pod whatever the job does: the run's end waits for the members it lost."""
        for kill in [kill for kill in self.kills if kill.at_step > metrics.logged]:
            while metrics.logged < kill.at_step:
                if await _stopped(stop, 0.2):
                    log.warning("chaos: the run ended before step %d closed: the node holding %s is not lost",
                                kill.at_step, kill.holding)
                    return
            try:
                spec = await asyncio.to_thread(self._kill, kill)
                if kill.replace_after_s < 0:
                    continue
                await asyncio.sleep(kill.replace_after_s)
                index = await asyncio.to_thread(self.cluster.add_node, spec)
                log.warning("chaos: node %d joined at %s with the lost node's labels %s", index, spec.ip, spec.labels)
            except Exception as err:  # the run goes on; the missing loss shows in its metrics
                log.error("chaos: could not lose the node holding %s: %s", kill.holding, err)

    def _kill(self, kill: NodeKill):
        node_id = get(self.actors[kill.holding].node_id.remote(), timeout_s=SMALL_CALL_S, what="node_id")
        ip = nodes.alive_address(node_id)
        if ip is None:
            raise ValueError(f"{kill.holding} runs on node {node_id[:8]}, which Ray does not list as alive")
        index = self.cluster.node_at(ip)
        if index == 0:
            raise ValueError(f"{kill.holding} runs on the head node ({ip}), which holds the driver")
        log.warning("chaos: killing node %d at %s (%s), which holds %s", index, ip, node_id[:8], kill.holding)
        return self.cluster.kill_node(index)

"""Join or start Ray, and turn resource pools into placement groups on labelled nodes.

Placement is decided here and in config, never inside an actor class: each role asks for
``Resources`` (pool, CPUs, GPUs), pinned by the ``ray_forge/pool`` node label when the config
names one. At start every pool is reserved whole, as one placement group with a bundle per actor,
so a pool that lacks room stops the run at once with what it lacks. Then:

- the trainer ranks and the reference keep their bundles (``PINNED``): a rank's loss stops the run;
- the engines and env actors, which Ray restarts wherever it finds room (the fleet waits for
  them), are placed by the node label and their resources alone, outside any placement group.
  A placed group that loses a node is *rescheduled* by Ray's GCS, which retries a bundle that
  cannot be placed again at once, with no backoff, until room appears: on a lost node that is not
  replaced the GCS took a whole core (and the dashboard agent, ingesting its event metrics,
  another) and starved its other work (ray-project/ray#65007, #65970). An actor pending a
  restart waits for room without that.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_forge.config.schema import POOL_LABEL, ClusterConfig, Resources

log = logging.getLogger(__name__)

NAMESPACE = "ray_forge"

PINNED = ("trainer", "reference")
"""Roles that keep their placement-group bundle for the whole run (the others are restarted by Ray
wherever their label has room; see the module's docstring)."""


class PlacementError(RuntimeError):
    """A pool's placement group could not be scheduled in time."""


def connect(config: ClusterConfig, namespace: str = NAMESPACE) -> bool:
    """Join the cluster we were submitted to, or start an embedded one. Returns True if started."""
    if ray.is_initialized():
        return False
    address = config.address
    if address == "auto":
        # `ray job submit` (and KubeRay's RayJob) set RAY_ADDRESS for the entrypoint.
        address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, namespace=namespace, log_to_driver=True)
        log.info("joined Ray cluster at %s", address)
        return False
    started = ray.init(
        num_cpus=config.num_cpus,
        num_gpus=None if config.num_gpus == "auto" else config.num_gpus,
        object_store_memory=config.object_store_memory_mb * 2**20,
        include_dashboard=config.include_dashboard,
        namespace=namespace,
        log_to_driver=True,
    )
    ctx = ray.get_runtime_context()
    dashboard = started.dashboard_url
    log.info("started an embedded Ray cluster (%d CPUs, %d GPUs, node %s); dashboard: %s",
             config.num_cpus, int(ray.cluster_resources().get("GPU", 0)), ctx.get_node_id()[:8],
             f"http://{dashboard}" if dashboard else
             "not running (Ray's dashboard log says why)" if config.include_dashboard else
             "off (cluster.include_dashboard is false)")
    return True


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: its placement group bundle (a pinned role), or else the node label its
    pool is pinned to (None: any node), and the resources it asks for."""

    resources: Resources
    placement_group: PlacementGroup | None = None
    bundle_index: int = -1
    label: str | None = None

    def options(self, name: str) -> dict:
        """Keyword arguments for ``ActorClass.options(...)``."""
        placement: dict = {}
        if self.placement_group is not None:
            placement["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=self.bundle_index)
        elif self.label:
            placement["label_selector"] = {POOL_LABEL: self.label}
        return dict(name=name, num_cpus=self.resources.num_cpus, num_gpus=self.resources.num_gpus, **placement)


class Pools:
    """Every pool reserved whole once, the pinned roles' bundles kept; hands out slots."""

    def __init__(self, config: ClusterConfig, pools: dict[str, list[tuple[str, Resources]]]) -> None:
        """``pools``: ``JobConfig.pools()``; resources still at ``num_gpus: auto`` get one GPU each
        if the cluster has GPUs."""
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        pools = {pool: [(role, res.resolved(gpus)) for role, res in members] for pool, members in pools.items()}
        self._groups: list[PlacementGroup] = []
        self.slots: dict[str, list[Slot]] = {role: [] for members in pools.values() for role, _ in members}
        try:
            for pool, members in pools.items():
                self._place(pool, members, config)
        except BaseException:
            self.release()
            raise

    def _place(self, pool: str, members: list[tuple[str, Resources]], config: ClusterConfig) -> None:
        # The whole pool first: a pool without room for all its actors stops the run now.
        remove_placement_group(self._reserve(pool, [res for _, res in members], config))
        label = config.pool_labels.get(pool)
        log.info("pool %s: room for %d actors%s", pool, len(members), f" on {POOL_LABEL}={label}" if label else "")
        pinned = [(role, res) for role, res in members if role in PINNED]
        if pinned:
            group = self._reserve(pool, [res for _, res in pinned], config)
            self._groups.append(group)
            for index, (role, res) in enumerate(pinned):
                self.slots[role].append(Slot(res, group, index))
        for role, res in members:
            if role not in PINNED:
                self.slots[role].append(Slot(res, label=label))

    def _reserve(self, pool: str, members: list[Resources], config: ClusterConfig) -> PlacementGroup:
        bundles = [_bundle(res) for res in members]
        label = config.pool_labels.get(pool)
        selector = [{POOL_LABEL: label} for _ in bundles] if label else None
        group = placement_group(bundles, strategy="PACK", name=f"ray_forge-{pool}", bundle_label_selector=selector)
        try:
            ray.get(group.ready(), timeout=config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            where = f"nodes labelled {POOL_LABEL}={label}" if label else "the cluster"
            raise PlacementError(
                f"pool {pool!r} needs bundles {bundles} on {where}, but they could not be placed within "
                f"{config.placement_timeout_s:.0f}s; cluster has {ray.available_resources()}"
            ) from None
        return group

    def need(self, role: str, pool_labels: dict[str, str]) -> str:
        """What one actor of ``role`` needs in order to be placed, in words (for a stop's message)."""
        res = self.slots[role][0].resources
        label = pool_labels.get(res.pool)
        where = f"a live node labelled {POOL_LABEL}={label}" if label else "a live node"
        return (f"pool {res.pool} lacks {_bundle(res)} for each on {where} "
                f"(free in the cluster now: {ray.available_resources()})")

    def release(self) -> None:
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()


def _bundle(res: Resources) -> dict[str, float]:
    bundle = {"CPU": res.num_cpus}
    if res.num_gpus:
        bundle["GPU"] = res.num_gpus
    return bundle

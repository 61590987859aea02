"""A multi-node Ray cluster on one machine, for rehearsals, tests and benchmarks.

Each node is a ``ray start --block`` in its own process group, with every port chosen free, so
it neither collides with another cluster on the machine (Ray's default ports may be taken) nor
survives its owner: :meth:`LocalCluster.stop` kills each group. Nodes get distinct loopback
addresses (127.0.0.2, 127.0.0.3, ...): ``ray start`` rewrites 127.0.0.1 to the host's address.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ray_forge.net import free_port

log = logging.getLogger(__name__)

STARTED = "Ray runtime started."
"""What ``ray start`` prints once its raylet has registered with the GCS."""
START_ATTEMPTS = 3

DROPPED = ("Remote end closed connection", "Connection aborted", "Connection reset by peer")
"""What ``ray job submit`` prints when the dashboard dropped the request (it may have been accepted)."""


@dataclass(frozen=True)
class NodeSpec:
    ip: str
    num_cpus: int = 2
    num_gpus: int = 0
    memory_bytes: int = 6 * 10**9
    """Caps what the node offers to tasks (by default a node claims most of the machine)."""
    object_store_bytes: int = 5 * 10**8
    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)


def _node_args(node: NodeSpec) -> list[str]:
    args = [f"--node-ip-address={node.ip}", f"--num-cpus={node.num_cpus}", f"--num-gpus={node.num_gpus}",
            f"--memory={node.memory_bytes}", f"--object-store-memory={node.object_store_bytes}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    if node.labels:
        args.append(f"--labels={json.dumps(node.labels)}")
    if node.resources:
        args.append(f"--resources={json.dumps(node.resources)}")
    return args


def _tail(log: Path, lines: int = 5) -> str:
    return f"{log} ends:\n" + "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


_joined: "LocalCluster | None" = None
"""The cluster this process joined with :meth:`LocalCluster.connect` (``chaos.kill_nodes`` kills its nodes)."""


def joined() -> "LocalCluster | None":
    """The local cluster this process started and joined, if it did (and has not stopped it)."""
    return _joined


class LocalCluster:
    """``with LocalCluster([NodeSpec("127.0.0.2"), NodeSpec("127.0.0.3")]) as c: c.connect()``"""

    def __init__(self, nodes: list[NodeSpec], *, dashboard: bool = False, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least a head node")
        self.nodes = list(nodes)
        """Every node started, in order (``procs[i]`` is node i's ``ray start``), replacements included."""
        self.dashboard = dashboard
        self.start_timeout_s = start_timeout_s
        bin_dir = Path(sys.executable).parent
        # Nodes and drivers must agree on auth. Ray 2.60 turns token auth on for `ray start` once
        # ~/.ray/auth_token exists, while a fresh driver defaults to none; and a process that ran
        # ray.init has RAY_AUTH_MODE=token in its environment, which Ray reads at import. So the
        # nodes take this process's mode, and no auth when it has none (they listen on loopback).
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
                        RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
                        PATH=f"{bin_dir}:{os.environ['PATH']}", **(env or {}))
        self.env.pop("RAY_ADDRESS", None)
        self.ray = str(bin_dir / "ray")
        self.temp_dir = Path("/tmp") / f"rf_{os.getpid()}_{free_port()}"  # short: socket paths are limited
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        """Each node's ``ray start`` output (its latest try)."""
        self.manager_ports: list[int] = []
        """Each node's raylet port (its latest try): how Ray's node table tells it apart."""

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.nodes[0].ip}:{self.dashboard_port}"

    def start(self) -> "LocalCluster":
        self._spawn_head()
        self._wait_started(0)
        for index in range(1, len(self.nodes)):
            self._spawn_worker(index)
        for index in range(1, len(self.nodes)):
            self._wait_started(index)
        return self

    def kill_node(self, index: int) -> NodeSpec:
        """Node ``index`` dies as a lost pod does: SIGKILL to its raylet, object store and workers at
        once, no goodbye to the GCS, which notices by the missed heartbeats. Returns its spec (for
        ``add_node``). The head cannot be killed: it holds the GCS."""
        if not 0 < index < len(self.procs):
            raise ValueError(f"node {index} is not a worker node of this cluster (0 is the head; {len(self.procs)} started)")
        proc = self.procs[index]
        if proc.poll() is not None:
            raise ValueError(f"node {index} ({self.nodes[index].ip}) is not running (rc {proc.returncode})")
        self._kill_group(proc)
        return self.nodes[index]

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        """SIGKILL to a ``ray start`` and everything under it: the raylet, the object store, the
        agents and the workers (each worker leads its own process group, so ``killpg`` alone misses
        them; they are found while they are still the raylet's children)."""
        import psutil

        try:
            group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            group = []
        for member in group:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    def add_node(self, node: NodeSpec) -> int:
        """Start one more worker node (a replacement, the same spec as a killed one); returns its index.
        It is alive once ``wait_for_nodes`` counts it."""
        self.nodes.append(node)
        index = len(self.nodes) - 1
        self._spawn_worker(index)
        self._wait_started(index)
        return index

    def alive(self) -> list[int]:
        """Indexes of the nodes whose ``ray start`` still runs."""
        return [i for i, proc in enumerate(self.procs) if proc.poll() is None]

    def wait_for_nodes(self, count: int, timeout_s: float | None = None) -> None:
        """Until Ray counts ``count`` live nodes (this process must be connected)."""
        from ray_forge.cluster import nodes

        timeout_s = timeout_s or self.start_timeout_s
        deadline = time.monotonic() + timeout_s
        while len(nodes.alive()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray counts {len(nodes.alive())} live nodes, not {count}, after {timeout_s:.0f}s")
            time.sleep(0.5)

    def _wait_for_running(self) -> None:
        """Until Ray counts every running node alive, each known by its raylet's port: a node killed
        earlier may or may not be declared dead yet, and its replacement has its address."""
        from ray_forge.cluster import nodes

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            alive = nodes.raylets_alive()
            missing = [i for i in self.alive() if (self.nodes[i].ip, self.manager_ports[i]) not in alive]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray does not count nodes {missing} alive after {self.start_timeout_s:.0f}s")
            time.sleep(0.5)

    def _spawn(self, cmd: list[str], index: int | None = None) -> None:
        """Start node ``index``'s ``ray start`` (a new node when None; a retry replaces the old one)."""
        index = len(self.procs) if index is None else index
        self.logs[index:index + 1] = [self.temp_dir.parent / f"{self.temp_dir.name}_{index}_{time.monotonic_ns()}.log"]
        [port] = [int(arg.split("=", 1)[1]) for arg in cmd if arg.startswith("--node-manager-port=")]
        self.manager_ports[index:index + 1] = [port]
        with open(self.logs[index], "w") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[index:index + 1] = [proc]

    def _spawn_head(self) -> None:
        # Fresh ports on every try, as for a worker; no worker has been given the address yet.
        head, self.gcs_port, self.dashboard_port = self.nodes[0], free_port(), free_port()
        self._spawn([self.ray, "start", "--head", "--block", f"--port={self.gcs_port}", f"--temp-dir={self.node_dir(0)}",
                     f"--include-dashboard={str(self.dashboard).lower()}", f"--dashboard-host={head.ip}",
                     f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}",
                     *_node_args(head)], 0)

    def _spawn_worker(self, index: int) -> None:
        # Fresh ports on every try: one chosen free may have been taken since (see ``free_port``).
        self._spawn([self.ray, "start", "--block", f"--address={self.address}", *_node_args(self.nodes[index]),
                     f"--temp-dir={self.node_dir(index)}"], index)

    def node_dir(self, index: int) -> Path:
        """Node ``index``'s temporary directory (its session's sockets and logs). Each node has its
        own: in one shared directory Ray names each node's sockets by the first free index, two
        nodes starting at once took the same name, and one raylet died on "bind: Address already in
        use" (11 of 18 worker starts needed a retry, alone on the machine)."""
        return self.temp_dir if index == 0 else Path(f"{self.temp_dir}_{index}")

    def log_dirs(self) -> list[Path]:
        """Every node's session log directory (the head's holds this process's driver log)."""
        return [self.node_dir(i) / "session_latest" / "logs" for i in range(len(self.procs))]

    def _wait_started(self, index: int) -> None:
        """Until node ``index``'s ``ray start`` says its raylet registered. It is tried again, with
        new ports, when it exits or hangs first: on a busy machine a port chosen free can be taken
        before the raylet binds it, and ``ray start`` gives up when its raylet has not registered
        with the GCS within 30 s (Ray's own bound), the head's too, which then takes its GCS down
        with it. Each try has ``start_timeout_s``; a worker's ends early if the head has exited."""
        for attempt in range(1, START_ATTEMPTS + 1):
            deadline = time.monotonic() + self.start_timeout_s
            while self.procs[index].poll() is None and time.monotonic() < deadline:
                if STARTED in self.logs[index].read_text(errors="replace"):
                    return
                if index and self.procs[0].poll() is not None:
                    raise RuntimeError(f"the head node exited (rc {self.procs[0].returncode}) while node {index} "
                                       f"started; {_tail(self.logs[0])}")
                time.sleep(0.2)
            failed, hung = self.logs[index], self.procs[index].poll() is None
            self._kill_group(self.procs[index])
            why = f"hung for {self.start_timeout_s:.0f}s" if hung else f"rc {self.procs[index].returncode}"
            if attempt < START_ATTEMPTS:
                log.warning("node %d (%s) failed to start (%s, see %s); trying again with new ports",
                            index, self.nodes[index].ip, why, failed)
                self._spawn_head() if index == 0 else self._spawn_worker(index)
        raise RuntimeError(f"node {index} ({self.nodes[index].ip}) failed to start {START_ATTEMPTS} times "
                           f"(last: {why}); {_tail(failed)}")

    def connect(self, **init_kwargs) -> None:
        """``ray.init`` this process into the cluster and wait until every node is alive."""
        import ray

        global _joined
        ray.init(address=self.address, **init_kwargs)
        _joined = self
        self._wait_for_running()

    def node_at(self, ip: str) -> int:
        """The index of the running node at ``ip`` (a node Ray reports by its address)."""
        running = [i for i in self.alive() if self.nodes[i].ip == ip]
        if not running:
            raise ValueError(f"no running node of this cluster is at {ip} "
                             f"(running: {[self.nodes[i].ip for i in self.alive()]})")
        return running[-1]

    def wait_for_jobs(self, timeout_s: float = 240.0) -> None:
        """Until the head's job API answers (it needs ``dashboard=True``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            probe = subprocess.run([self.ray, "job", "list", "--address", self.dashboard_url],
                                   capture_output=True, text=True, env=self.env, timeout=60)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job API at {self.dashboard_url} did not answer within {timeout_s:.0f}s: "
                                   f"{probe.stderr.strip()[-500:]}")
            time.sleep(2)

    def submit(self, entrypoint: list[str], working_dir: str | Path, submission_id: str,
               timeout_s: float = 900.0, wait: bool = True) -> tuple[str, subprocess.CompletedProcess]:
        """``ray job submit`` to this cluster, waiting for the job's end unless ``wait`` is False:
        (submission id, process).

        The head's job agent can register a minute or more after the job API answers on a busy
        machine; until then every submit is refused and nothing runs, so those are retried. On a
        busy machine the dashboard may also drop the submitting connection: the job may have been
        accepted, so it is looked up by its id and followed if it was, and submitted again if not."""
        deadline, attempt = time.monotonic() + 240, 0
        while True:
            job_id = submission_id if attempt == 0 else f"{submission_id}-{attempt}"
            proc = subprocess.run([self.ray, "job", "submit", "--address", self.dashboard_url, "--submission-id", job_id,
                                   "--working-dir", str(working_dir), *([] if wait else ["--no-wait"]), "--",
                                   *entrypoint],
                                  capture_output=True, text=True, env=self.env, timeout=timeout_s)
            out = proc.stdout + proc.stderr
            if time.monotonic() > deadline:
                return job_id, proc
            if any(sign in out for sign in DROPPED):
                status = self._job("status", job_id)
                if status.returncode == 0:  # accepted before the connection dropped
                    return job_id, self._follow(job_id, timeout_s) if wait else status
                time.sleep(5)
                continue
            if "No available agent" not in out:
                return job_id, proc
            attempt += 1
            time.sleep(5)

    def _job(self, command: str, job_id: str, *flags: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.ray, "job", command, "--address", self.dashboard_url, *flags, job_id],
                              capture_output=True, text=True, env=self.env, timeout=timeout_s)

    def _follow(self, job_id: str, timeout_s: float) -> subprocess.CompletedProcess:
        """What ``ray job submit`` would have printed and returned for a job already submitted:
        its logs to the end, then its status (exit 0 only if it succeeded)."""
        logs = self._job("logs", job_id, "--follow", timeout_s=timeout_s)
        status = self._job("status", job_id)
        done = "succeeded" in status.stdout.lower()
        return subprocess.CompletedProcess(logs.args, 0 if done else 1, logs.stdout + status.stdout,
                                           logs.stderr + status.stderr)

    def stop(self, keep_files: bool = False) -> None:
        """Stops every node; their sockets, session logs and ``ray start`` outputs are deleted
        unless ``keep_files`` (a failure's evidence: ``with`` keeps them when its block raised)."""
        global _joined
        if _joined is self:
            _joined = None
        # SIGTERM to each `ray start` alone, workers first: it drains its node and stops its own
        # processes. Sent to the whole group it also ended the head's GCS at once, and the head's
        # `ray start` then waited 30 s for a GCS to drain through (a 33-57 s teardown, per cluster).
        for proc in reversed(self.procs):
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything its `ray start` left behind
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)
        # Workers Ray started outside the groups (none expected) would still name the temp dir.
        subprocess.run(["pkill", "-f", str(self.temp_dir)], check=False)
        self.procs.clear()
        files = [path for path in self.files() if path.exists()]
        if keep_files:
            log.warning("the local cluster's node files are kept: %s", " ".join(map(str, files)))
            return
        for path in files:  # each cluster left ~1 MB to ~30 MB of these behind, never reused
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        """What its nodes write on this machine: each node's directory (sockets, session logs) and
        every try's ``ray start`` output, the replaced ones too."""
        return [*(self.node_dir(i) for i in range(len(self.nodes))),
                *sorted(self.temp_dir.parent.glob(f"{self.temp_dir.name}_*.log"))]

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.stop(keep_files=True)
            raise

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(keep_files=exc_type is not None)

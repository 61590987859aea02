"""Push transport over torch.distributed collectives: gloo on CPU, NCCL on GPU, one code path.

Every trainer rank that publishes owns one process group of its own, never the default group
(the ranks use that one for FSDP): itself as group rank 0 and every worker of every engine in
the push as ranks ``1 + engine_index * workers_per_receiver + worker``. Each rank broadcasts its
own buckets, in order, in its group; an engine worker takes part in every rank's group and
receives group by group (rank 0's bucket ``g``, rank 1's bucket ``g``, then ``g + 1``), into
staging buffers. Only when every bucket has arrived does the engine load them, so a failed
transfer leaves it serving its previous version.

Who takes part is decided per push by the driver (the fleet's live engines) through the store's
controller, which also hosts the rendezvous ``TCPStore``. The groups are kept from push to push
and rebuilt (a new *generation*) when the engines taking part change, one restarted, or a push
failed. Every wait is bounded by the spec's timeout and names whom it waited for:

- members announce themselves before a group is built (``join``); a missing one is named;
- every receiver says it is ready before the bytes flow, and acknowledges the end (``status``);
  a sender names the receivers that did not acknowledge, a receiver names the sender rank whose
  bucket did not arrive;
- whoever fails aborts its groups (so peers blocked in a collective fail at once instead of at
  their timeout) and tells the controller, which wakes every waiting member (``abort``).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ray_forge.weights.base import Manifest, Part, StoreSpec, SyncNotOpened, WeightSyncError, version_key
from ray_forge.weights.controller import CONTROLLER_TIMEOUT_S, ControllerClient
from ray_forge.weights.layout import Bucket, pack_into
from ray_forge.weights.rendezvous import Session
from ray_forge.weights.staging import drop_staging, receiving_device, staging_for

log = logging.getLogger(__name__)

_POLL_S = 0.05
_RECEIVER_GRACE_S = 3.0
"""A receiver waits this much longer for the bytes than a sender waits for the receivers, so that
when a receiver is missing, the sender (which knows who) reports first."""
_ACK_GRACE_S = 5.0
"""After a failed broadcast, how long a sender waits for the surviving receivers to report, so
that the ones it names as silent are the dead or stuck ones."""


class _BroadcastFailed(WeightSyncError):
    """A collective of the transfer itself failed (not a rendezvous)."""


class MissedPush(WeightSyncError):
    """This process is not a member of the push (it restarted after the groups were built)."""


class CollectiveTransport:
    """One per process: its rendezvous client and its groups (by generation); an engine receives
    into this process's staging (``staging.py``), which its worker then loads from."""

    def __init__(self, spec: StoreSpec, client: ControllerClient) -> None:
        self.spec, self.controller = spec, client
        self.device = receiving_device()
        self._client: dist.TCPStore | None = None
        self._client_address: tuple[str, int] | None = None
        self.generation = 0
        self.groups: dict[int, object] = {}
        """Sender rank -> process group, for ``self.generation``."""
        self._send_buffer: torch.Tensor | None = None
        self._pushed: list[Session] = []

    def free(self, part: Part) -> None:
        pass  # a push stores nothing

    def destroy(self) -> None:
        self._drop_groups()
        drop_staging(self.spec.name)

    # -- sender --------------------------------------------------------------------------------
    def put(self, part: Part, tensors: Mapping[str, torch.Tensor], publish: Callable[[Part], None]) -> Part:
        """Publish this rank's layout (receivers learn it from the manifest), then broadcast its
        buckets to every engine worker of the push of ``part.version``. Returns once every receiver
        has acknowledged them; raises WeightSyncError naming the receivers that did not (and tells
        everyone the push failed)."""
        publish(part)
        deadline = time.monotonic() + self.spec.timeout_s
        session = self._session(part.version, deadline, who=part.sender)
        client = self._store(session)
        try:
            self._send(part, tensors, session, client, deadline)
        except Exception as err:
            # Any failure (packing a bucket included) is told to everyone, or the receivers would wait it out.
            self._fail(session, str(err) if isinstance(err, WeightSyncError)
                       else f"{part.sender}: {type(err).__name__}: {err}")
            if not isinstance(err, _BroadcastFailed):
                raise
            # Our groups are aborted: survivors fail at once and report; the silent ones are the dead or stuck.
            grace_s = min(_ACK_GRACE_S, deadline - time.monotonic())
            silent = self._silent(client, session, part.version, part.rank, grace_s)
            raise WeightSyncError(f"{err}; receivers that did not acknowledge: {', '.join(silent) or 'none'}") from None
        self._forget(client, session, part.rank)
        return part

    def _send(self, part: Part, tensors: Mapping[str, torch.Tensor], session: Session, client: dist.TCPStore,
              deadline: float) -> None:
        what = f"push of weights version {part.version} from {part.sender}"
        receivers = range(1, session.group_size)
        group = self._group(session, part.rank, 0, deadline)
        self._wait_all(client, session, {session.key(version_key(part.version), "ready", r): r for r in receivers},
                       deadline, part.rank, f"{what}: receivers not ready")
        for bucket in part.buckets:
            try:
                self._broadcast(group, self._pack(bucket, tensors), session, client, deadline,
                                f"{what}, bucket {bucket.index}")
            except WeightSyncError as err:
                raise _BroadcastFailed(str(err)) from None
        statuses = {session.key(version_key(part.version), "status", r): r for r in receivers}
        self._wait_all(client, session, statuses, deadline, part.rank, f"{what}: no acknowledgement")
        answers = {r: client.get(k).decode() for k, r in statuses.items()}
        if failed := {r: a for r, a in answers.items() if a != "ok"}:
            raise WeightSyncError(f"{what} failed on receivers: " + "; ".join(
                f"{session.member_name(r, part.rank)}: {reason}" for r, reason in failed.items()))

    def _forget(self, client: dist.TCPStore, session: Session, rank: int) -> None:
        """Rank 0 deletes the acknowledgements of its push before last: every sender has read them
        (the ranks step together), so the rendezvous store does not grow with the run."""
        if rank != 0:
            return
        self._pushed.append(session)
        if len(self._pushed) > 2:
            old = self._pushed.pop(0)
            for r in range(1, old.group_size):
                for kind in ("ready", "status"):
                    client.delete_key(old.key(version_key(old.version), kind, r))

    def _pack(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This bucket's bytes in one reused send buffer (the sender holds one bucket beyond its shard)."""
        if self._send_buffer is None or self._send_buffer.numel() < bucket.nbytes:
            self._send_buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        buffer = self._send_buffer[:bucket.nbytes]
        pack_into(bucket, tensors, buffer)
        return buffer

    # -- receiver ------------------------------------------------------------------------------
    def fetch(self, version: int, member: str, worker: int, deadline: float) -> Manifest | None:
        """Receive every bucket of ``version`` into this process's staging; None when ``member``
        is not part of that push (it was restarting when the push began: the next push's groups
        are rebuilt with it). Loading is the caller's next step."""
        session = self._session(version, deadline, who=member or "a reader")
        if member not in session.receivers or session.closed:
            if member and session.generation != self.generation:
                self.controller.receiver_restarted(member, timeout_s=CONTROLLER_TIMEOUT_S)
            return None
        manifest = self.controller.manifest(version, deadline)
        me = session.group_rank(member, worker)
        client = self._store(session)
        name = session.member_name(me, 0)
        if session.generation != self.generation and session.first_version == session.version:
            # Say we are here to every sender's group at once: the groups are then built one after the
            # other, and a sender still waiting for the others names only the members that are missing.
            for part in manifest.parts:
                client.set(session.key(f"s{part.rank}", "join", me), "1")
        try:
            groups = {p.rank: self._group(session, p.rank, me, deadline) for p in manifest.parts}
        except MissedPush as err:
            self._fail(session, str(err))
            return None
        except WeightSyncError as err:
            self._fail(session, f"{name}: {err}")
            raise
        staging = staging_for(self.spec.name, _allocate)
        buffers = staging.prepare(manifest, self.device)
        client.set(session.key(version_key(version), "ready", me), "1")
        # The senders know who is missing: let them time out first and name the culprit in their abort.
        data_deadline = deadline + _RECEIVER_GRACE_S
        try:
            for part, bucket in manifest.in_group_order():
                what = f"{name}: bucket {bucket.index} of weights version {version} from {part.sender} " \
                       f"(trainer rank {part.rank})"
                self._broadcast(groups[part.rank], buffers[(part.rank, bucket.index)], session, client,
                                data_deadline, what)
        except WeightSyncError as err:
            client.set(session.key(version_key(version), "status", me), f"failed: {err}")
            self._fail(session, str(err))
            raise
        client.set(session.key(version_key(version), "status", me), "ok")
        staging.mark(version)
        return manifest

    def read(self, part: Part, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """The buckets this process received (a push stores nothing anywhere else)."""
        yield from staging_for(self.spec.name, _allocate).read(part)

    def holds(self, manifest: Manifest) -> bool:
        staging = staging_for(self.spec.name, _allocate)
        return all(staging.holds(part) for part in manifest.parts)

    def route(self) -> str:
        return f"collective ({'nccl' if self.device.type == 'cuda' else 'gloo'} broadcast)"

    # -- groups --------------------------------------------------------------------------------
    def _session(self, version: int, deadline: float, who: str) -> Session:
        session = self.controller.push_session(version, deadline)
        if session is None:
            raise SyncNotOpened(f"no push of weights version {version} was opened within {self.spec.timeout_s:.0f}s "
                                f"(waiting in {who}): the driver opens it in Fleet.sync, which must run at the "
                                "same time as the trainer's publish_weights")
        return session

    def _store(self, session: Session) -> dist.TCPStore:
        if self._client_address != (session.host, session.port):
            self._client = dist.TCPStore(session.host, session.port, is_master=False,
                                         timeout=timedelta(seconds=max(10.0, self.spec.timeout_s)))
            self._client_address = (session.host, session.port)
        return self._client

    def _group(self, session: Session, sender_rank: int, me: int, deadline: float):
        """This process's group with sender ``sender_rank`` for the session's generation, built
        (all members at once) when the generation is new to it."""
        if session.generation != self.generation:
            self._drop_groups()
            self.generation = session.generation
        if sender_rank in self.groups:
            return self.groups[sender_rank]
        if session.first_version != session.version:
            raise MissedPush(f"{session.member_name(me, sender_rank)} has no group of generation "
                             f"{session.generation} (built at version {session.first_version}): it restarted since; "
                             "the groups are rebuilt for the next push")
        client = self._store(session)
        client.set(session.key(f"s{sender_rank}", "join", me), "1")
        joins = {session.key(f"s{sender_rank}", "join", r): r for r in range(session.group_size)}
        self._wait_all(client, session, joins, deadline, sender_rank,
                       f"group of {session.senders[sender_rank]} for weights version {session.version}: did not join")
        prefix = dist.PrefixStore(session.key(f"s{sender_rank}", "pg") + "/", client)
        # Every member has joined, so connecting is quick. Our own polling enforces the deadlines; the
        # group's timeout is a backstop past them, so that it never pre-empts a sender naming the culprit.
        timeout = timedelta(seconds=self.spec.timeout_s + 2 * _RECEIVER_GRACE_S)
        try:
            self.groups[sender_rank] = _new_group(prefix, me, session.group_size, timeout, self.device)
        except RuntimeError as err:  # a member left between joining and connecting
            raise WeightSyncError(f"{session.member_name(me, sender_rank)} could not connect the group of "
                                  f"{session.senders[sender_rank]}: {_first_line(err)}") from None
        return self.groups[sender_rank]

    def _drop_groups(self) -> None:
        for group in self.groups.values():
            try:
                group.abort()  # peers blocked in a collective with us fail now, not at their timeout
            except Exception as err:  # an already broken group may refuse; it is dropped either way
                log.debug("abort of a push group: %s", err)
        self.groups.clear()

    def _fail(self, session: Session, reason: str) -> None:
        self._drop_groups()
        try:
            self.controller.push_failed(session.generation, reason)
        except WeightSyncError as err:  # the failure itself is what the caller reports
            log.warning("could not report a failed push to the weight store controller: %s", err)

    # -- waits ---------------------------------------------------------------------------------
    def _wait_all(self, client: dist.TCPStore, session: Session, keys: dict[str, int], deadline: float,
                  sender_rank: int, what: str) -> None:
        """Until every key exists; at the deadline, name the members whose key is missing."""
        pause = 0.002
        while not client.check(list(keys)):
            aborted, late = client.check([session.abort_key]), time.monotonic() > deadline
            if aborted or late:
                missing = ", ".join(session.member_name(r, sender_rank) for k, r in keys.items()
                                    if not client.check([k]))
                if aborted:
                    raise WeightSyncError(f"{what} ({missing}) before the push was aborted: "
                                          f"{client.get(session.abort_key).decode()}")
                raise WeightSyncError(f"{what} within {self.spec.timeout_s:.0f}s: {missing}")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)

    def _silent(self, client: dist.TCPStore, session: Session, version: int, sender_rank: int,
                grace_s: float) -> list[str]:
        """Receivers that reported neither success nor failure within ``grace_s`` (dead or stuck)."""
        keys = {session.key(version_key(version), "status", r): r for r in range(1, session.group_size)}
        end = time.monotonic() + max(0.0, grace_s)
        while not client.check(list(keys)) and time.monotonic() < end:
            time.sleep(_POLL_S)
        return [session.member_name(r, sender_rank) for k, r in keys.items() if not client.check([k])]

    def _broadcast(self, group, buffer: torch.Tensor, session: Session, client: dist.TCPStore, deadline: float,
                   what: str) -> None:
        """Broadcast from group rank 0, polled so that the deadline and an abort end the wait."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = group.broadcast([buffer], options)
        pause, next_abort_check = 0.0005, time.monotonic() + 0.5
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise WeightSyncError(f"{what} did not complete within {self.spec.timeout_s:.0f}s")
            if now > next_abort_check:
                if client.check([session.abort_key]):
                    raise WeightSyncError(f"{what}: the push was aborted: {client.get(session.abort_key).decode()}")
                next_abort_check = now + 0.5
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        try:
            work.wait()
        except RuntimeError as err:
            # A peer that gave up aborted its groups; its reason (which names the culprit) says more than ours.
            why = f"; the push was aborted: {client.get(session.abort_key).decode()}" \
                if client.check([session.abort_key]) else ""
            raise WeightSyncError(f"{what} failed: {_first_line(err)}{why}") from None


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _new_group(store, rank: int, size: int, timeout: timedelta, device: torch.device):
    """A process group outside the default one: NCCL between GPUs, gloo between CPUs."""
    if device.type == "cuda":
        # NCCL builds its communicator inside the first collective, blocking by default: a peer
        # dead by then would hang it past our polling of the broadcast. Non-blocking, the wait on
        # the work (which our deadline polls) covers it. Not yet run on a GPU.
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _first_line(err: Exception) -> str:
    """The error's first line, without gloo's boilerplate advice."""
    text = str(err).strip().splitlines()
    return text[0].split(" This is typically caused by")[0] if text else err.__class__.__name__

"""Continuous batching for a policy actor: one thread owns vLLM's engine and steps it.

vLLM's ``LLMEngine`` is not thread-safe and its ``AsyncLLM`` cannot run in-process (see
``docs/design/streaming_vllm_research.md``), so a single thread adds requests, steps the engine
and runs everything else that touches it (a weight load, a cache reset, an RPC to its workers)
between two steps. Any other thread hands it work through a queue and waits on a future.
Requests that arrive while others run join the running batch at the next step.

A weight update is one such piece of work: generation pauses for the load only, not for the
requests in flight to finish. Requests in flight are preempted by the prefix-cache reset and
resume on the new weights (their tokens so far are kept), so each token is labelled with the
version that sampled it (``token_versions``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)


class EngineLoop:
    """Steps ``engine`` on its own thread. ``submit`` adds requests; ``run`` runs a function
    between two steps; ``update`` loads new weights between two steps."""

    def __init__(self, engine, version: int = 0, on_failure: Callable[[BaseException], None] | None = None,
                 name: str = "vllm-step-loop") -> None:
        self.engine = engine
        self._on_failure = on_failure
        self.steps = 0
        """Engine steps taken so far."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, Future] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.version = version
        """The version new tokens are labelled with (see ``label``)."""
        engine.set_weight_version(str(version))
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------
    def submit(self, requests: list[tuple[list[int], Any]], priority: int = 0) -> list[Future]:
        """One future per (prompt token ids, SamplingParams); each resolves to the request's
        final ``RequestOutput`` (all ``n`` samples). Waiting requests with a lower ``priority``
        are scheduled first (the engine must use vLLM's priority scheduling)."""
        futures = [Future() for _ in requests]
        self._put(("add", (requests, priority), futures))
        return futures

    def run(self, fn: Callable[[Any], Any]) -> Future:
        """``fn(engine)`` on the loop thread, between two steps."""
        future = Future()
        self._put(("run", fn, future))
        return future

    def update(self, load: Callable[[Any], Any], version: int) -> Future:
        """``load(engine)`` between two steps, then the prefix cache is dropped and running
        requests continue on the new weights; resolves to (``load``'s result, seconds generation
        stood still). A ``load`` that returns False loaded nothing: the engine keeps its version
        and its cache."""
        future = Future()
        self._put(("update", (load, version), future))
        return future

    def abort(self, futures: list[Future]) -> None:
        """Drop the requests behind ``futures`` (their caller gave up): they stop taking batch slots."""
        wanted = set(map(id, futures))

        def drop(engine) -> None:
            ids = [rid for rid, future in self._waiting.items() if id(future) in wanted]
            for rid in ids:
                # Another call may share the request (see DistributionDraws.submit): it fails now, not at its own timeout.
                self._waiting.pop(rid).set_exception(TimeoutError(f"request {rid} was aborted by a caller that gave up"))
            engine.abort_request(ids)

        self.run(drop)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop stepping; requests still waiting fail. False if the loop thread is still busy
        after ``timeout_s`` (inside a long load): the engine must not be shut down under it."""
        with self._lock:
            if self._thread.is_alive() and self._error is None:
                self._inbox.put(("stop", None, None))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _put(self, message: tuple) -> None:
        with self._lock:  # against the loop dying between the check and the put: no future is left behind
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the engine loop has stopped: {self._error!r}")
            self._inbox.put(message)

    # -- the loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                # Block only when there is nothing to step; else take what arrived since the last step.
                if not self._drain(block=idle):
                    self._fail_all(RuntimeError("the engine loop was stopped"))
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as err:  # the engine broke: nobody waiting may hang
            log.exception("the vLLM engine loop failed")
            self._fail_all(RuntimeError(f"the vLLM engine loop failed: {err!r}"))
            if self._on_failure is not None:
                self._on_failure(err)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request and queued message: nobody waits on a loop that is gone."""
        with self._lock:
            self._error = error
            futures = [*self._waiting.values(), *self._pending()]
        self._waiting.clear()
        for future in futures:
            if not future.done():
                future.set_exception(error)

    def _pending(self) -> list[Future]:
        futures = []
        while True:
            try:
                kind, payload, future = self._inbox.get_nowait()
            except queue.Empty:
                return futures
            futures += future if kind == "add" else [future] if future is not None else []

    def _drain(self, block: bool) -> bool:
        """Handle queued messages; False on stop."""
        while True:
            try:
                kind, payload, future = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload, future)
            elif kind == "run":
                _settle(future, lambda: payload(self.engine))
            elif kind == "update":
                self._update(*payload, future)

    def _add(self, payload: tuple[list, int], futures: list[Future]) -> None:
        requests, priority = payload
        for (prompt_ids, params), future in zip(requests, futures, strict=True):
            # An id prefix of our own: the offline LLM API numbers its requests "0", "1", ...
            request_id = f"rf-{next(self._ids)}"
            try:
                self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params, priority=priority)
            except Exception as err:  # bad parameters fail that request only
                future.set_exception(err)
                continue
            self._waiting[request_id] = future

    def _update(self, load: Callable, version: int, future: Future) -> None:
        start = time.monotonic()
        try:
            result = load(self.engine)
            if result is not False:  # something was loaded (see ``update``)
                self._drop_cached_prefixes(version)
        except Exception as err:
            future.set_exception(err)
        else:
            future.set_result((result, time.monotonic() - start))

    def _drop_cached_prefixes(self, version: int) -> None:
        # Cached prefixes hold keys and values of the old weights. With requests running, a plain
        # reset frees nothing (and returns False): preempting them recomputes their context on the
        # new weights, keeping the tokens they sampled.
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            self.label(-1)  # new weights, old cached prefixes: tokens from here on belong to no version
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update: cached "
                               "prefixes would mix two policy versions")
        self.label(version)

    def label(self, version: int) -> None:
        """Tokens sampled from now on carry ``version`` (on the loop thread: from a ``load``)."""
        self.engine.set_weight_version(str(version))
        self.version = version

    def _step(self) -> None:
        outputs = self.engine.step()
        self.steps += 1
        for output in outputs:
            if output.finished:
                future = self._waiting.pop(output.request_id, None)
                if future is not None:
                    future.set_result(output)


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as err:
        future.set_exception(err)


def token_versions(sample) -> tuple[int, ...]:
    """The policy version of each token of one ``CompletionOutput``, from vLLM's weight-version spans."""
    spans = sample.weight_versions
    if spans is None:
        if not sample.token_ids:
            return ()
        raise RuntimeError("vLLM returned tokens without a weight-version label: which policy sampled them is unknown")
    versions: list[int] = []
    for span in spans:
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != len(sample.token_ids):
        raise RuntimeError(f"vLLM's weight-version spans cover {len(versions)} of {len(sample.token_ids)} tokens")
    return tuple(versions)

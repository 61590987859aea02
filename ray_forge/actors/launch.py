"""Start every actor of the GRPO job on its pool, and stop them all."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_forge.actors.buffer import BufferActor
from ray_forge.actors.env_pool import EnvPoolActor
from ray_forge.actors.policy import PolicyActor
from ray_forge.actors.reference import ReferenceActor
from ray_forge.actors.trainer import TrainerActor
from ray_forge.actors.trainer_group import TrainerGroup
from ray_forge.cluster import nodes
from ray_forge.cluster.pools import Pools
from ray_forge.config.schema import POOL_LABEL, GRPOConfig, JobConfig, TrainerConfig
from ray_forge import identity
from ray_forge.core.actions import multi_token_actions, require_action_words
from ray_forge.core.chat import TOOL_CALL_CLOSE, ChatFormat
from ray_forge.core.env import EnvSetup
from ray_forge.identity import ActorId, Role
from ray_forge.remote import SHUTDOWN_S, SMALL_CALL_S, get
from ray_forge.weights import StoreSpec, WeightStore, resolve_transport

log = logging.getLogger(__name__)

ANSWER_FLOOR_S = 1.0
"""Even past the engines' start deadline, one that is up gets this long to say where it runs."""

# Actors read no secrets and download nothing: models are local folders.
# vLLM logs every weight reload at INFO; keep `ray job logs` readable.
_OFFLINE_ENV = {"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                             "VLLM_LOGGING_LEVEL": "ERROR"}}


@dataclass
class Actors:
    policies: list
    envs: list
    buffer: object
    trainer: TrainerGroup
    reference: object | None
    store: WeightStore
    pools: Pools
    model_dir: str = ""
    """The base model every engine, rank and the reference started from."""
    tool_tags: str | None = None
    """A sequence run's tool-call tags: ``text`` in the model's vocabulary, or ``tokens`` of their own."""
    _all: list = field(default_factory=list)

    def by_name(self) -> dict[str, object]:
        """Engines, env actors and trainer ranks by their names (``policy-1``)."""
        return ({str(identity.policy(i)): p for i, p in enumerate(self.policies)}
                | {str(identity.env(i)): e for i, e in enumerate(self.envs)}
                | {str(identity.trainer(r)): rank for r, rank in enumerate(self.trainer.ranks)})

    def shutdown(self, gone: Collection[ActorId] = ()) -> None:
        """Polite shutdown (vLLM engine cores, envs' sessions and sandboxes, process groups), then
        kill, then free the pools. ``gone``: members not asked (lost with their node, say), as each
        would only time out."""
        polite = [(p.shutdown, "shutdown", identity.policy(i)) for i, p in enumerate(self.policies)]
        polite += [(e.close, "close", identity.env(i)) for i, e in enumerate(self.envs)]
        for method, name, actor in polite:
            if actor in gone:
                continue
            try:
                get(method.remote(), timeout_s=SHUTDOWN_S, what=name, actor=actor)
            except Exception as err:  # the actor may already be dead
                log.warning("%s", err)
        self.trainer.shutdown()
        for handle in self._all:
            ray.kill(handle, no_restart=True)
        self.pools.release()
        try:
            self.store.destroy()
        except Exception as err:  # the controller may be gone; shm folders are still removed below
            log.warning("weight store cleanup: %s", err)
            self.store.close()


def chat_tokenizer(model_dir: str):
    """The model folder's tokenizer, with its chat template; fails naming what is missing."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatFormat(tokenizer)  # a tokenizer without a template, or without the tokens it needs, stops here
    log.info("tool-call tags: %s", "tokens of their own" if chat.tool_tags == "tokens" else
             f"text in the model's vocabulary ({TOOL_CALL_CLOSE} is {len(tokenizer.encode(TOOL_CALL_CLOSE, add_special_tokens=False))} tokens)")
    return tokenizer


def start_actors(config: JobConfig, env: EnvSetup, model_dir: str, store_name: str) -> Actors:
    """Create all actors at once (their start-ups overlap), then wait for them to be ready."""
    pools = Pools(config.cluster, config.pools(gpus=ray.cluster_resources().get("GPU", 0) > 0))
    handles: list = []
    try:
        return _start_on(pools, config, env, model_dir, store_name, handles)
    except BaseException:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        pools.release()
        raise


def _start(actor, placement: dict, section, *, max_restarts: int = 0, **found):
    """Every actor starts the same way: its resources and placement from config at ``.options()``,
    its own config section first, then what the run found out (the model folder, its rank, the
    action tokens) as keywords."""
    return actor.options(**placement, runtime_env=_OFFLINE_ENV, max_restarts=max_restarts).remote(section, **found)


def _start_on(pools: Pools, config: JobConfig, env: EnvSetup, model_dir: str, store_name: str,
              handles: list) -> Actors:
    slots = pools.slots
    # A sequence episode is rendered by the model's own chat template, in the env actors.
    tokenizer = chat_tokenizer(model_dir) if config.env.episode.mode == "sequence" else None
    envs = [_start(EnvPoolActor, slot.options(str(identity.env(i))), config.env, max_restarts=config.env.max_restarts, env=env,
                   tokenizer=tokenizer)
            for i, slot in enumerate(slots["env"])]
    handles += envs
    action_words = get(envs[0].get_action_words.remote(), timeout_s=config.env.call_timeout_s,
                       what="get_action_words", actor=identity.env(0))
    if config.policy.constrain_to_actions:
        require_action_words(config.env.name, action_words)
    policies = [_start(PolicyActor, slot.options(str(identity.policy(i))), config.policy, max_restarts=config.policy.max_restarts,
                       model_dir=model_dir, action_words=action_words, seed=config.run.seed + i, store_name=store_name)
                for i, slot in enumerate(slots["policy"])]
    handles += policies
    started_by = time.monotonic() + config.policy.start_timeout_s  # one bound for all the engines' start
    allowed = get(policies[0].get_allowed_token_ids.remote(), timeout_s=config.policy.start_timeout_s,
                  what="get_allowed_token_ids (vLLM engine start, policy.start_timeout_s)", actor=identity.policy(0))
    if config.policy.constrain_to_actions and allowed is None:
        raise multi_token_actions(action_words)
    ranks = start_trainer_ranks(config.trainer, slots["trainer"], model_dir, config.run.steps, grpo=config.grpo,
                                allowed_token_ids=allowed, temperature=config.policy.temperature)
    handles += ranks
    reference = None
    if config.grpo.kl_coef > 0:
        reference = _start(ReferenceActor, slots["reference"][0].options("ref"), config.reference, model_dir=model_dir,
                           allowed_token_ids=allowed, temperature=config.policy.temperature,
                           micro_batch_size=config.trainer.micro_batch_size)
        handles.append(reference)
    # On the driver's node, in no pool: the buffer writes its part of each checkpoint into the run directory.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    buffer = _start(BufferActor, dict(name="buffer", num_cpus=config.buffer.num_cpus, scheduling_strategy=here),
                    config.buffer)
    handles.append(buffer)
    trainer = TrainerGroup(ranks, config.trainer.call_timeout_s)
    num_params = trainer.setup()
    # The other engines may still be starting: each answers once its constructor is done.
    policy_nodes = get([p.node_id.remote() for p in policies], timeout_s=max(ANSWER_FLOOR_S, started_by - time.monotonic()),
                       what="policies (vLLM engine start, policy.start_timeout_s)")
    trainer_nodes = trainer.nodes
    transport = resolve_transport(config.weights.transport, trainer_nodes, policy_nodes)
    store = WeightStore.create(store_spec(config, store_name, transport))
    actors = Actors(policies, envs, buffer, trainer, reference, store, pools, model_dir,
                    tool_tags=tokenizer and ChatFormat(tokenizer).tool_tags, _all=handles)
    log.info("actors ready: %d policy, %d trainer ranks (%.2fM params), %d env, reference=%s, weights over %s",
             len(policies), len(ranks), num_params / 1e6, len(envs), reference is not None, transport)
    env_nodes = get([e.node_id.remote() for e in envs], timeout_s=SMALL_CALL_S, what="env actors")
    log_placement({**dict(zip(identity.all_of(Role.POLICY, len(policies)), policy_nodes)),
                   **dict(zip(identity.all_of(Role.TRAINER, len(ranks)), trainer_nodes)),
                   **dict(zip(identity.all_of(Role.ENV, len(envs)), env_nodes))})
    return actors


def start_trainer_ranks(trainer: TrainerConfig, slots: list, model_dir: str, total_steps: int, *,
                        grpo: GRPOConfig | None = None, allowed_token_ids: list[int] | None = None,
                        temperature: float = 1.0) -> list:
    """The TorchTitan ranks ``trainer-<r>``, one per slot (the GRPO job's and the SFT job's)."""
    return [_start(TrainerActor, slot.options(str(identity.trainer(r))), trainer, grpo=grpo or GRPOConfig(), model_dir=model_dir,
                   total_steps=total_steps, rank=r, allowed_token_ids=allowed_token_ids, temperature=temperature)
            for r, slot in enumerate(slots)]


def log_placement(actor_nodes: dict[ActorId, str]) -> None:
    """One line per node: its address, its pool label and the actors on it."""
    by_node: dict[str, list[str]] = {}
    for actor, node_id in actor_nodes.items():
        by_node.setdefault(node_id, []).append(str(actor))
    for node_id, names in by_node.items():
        node = nodes.find(node_id)
        log.info("node %s (%s=%s): %s", nodes.address(node) or node_id[:8], POOL_LABEL, nodes.pool(node) or "-",
                 ", ".join(names))


def store_spec(config: JobConfig, name: str, transport: str) -> StoreSpec:
    weights = config.weights
    return StoreSpec(
        name=name, transport=transport, sender=str(identity.trainer(0)),
        senders=tuple(map(str, identity.all_of(Role.TRAINER, config.trainer.num_ranks))),
        keep_versions=weights.keep_versions, bucket_bytes=weights.bucket_mb * 2**20, timeout_s=weights.timeout_s,
        dtype=config.policy.dtype if weights.dtype == "auto" else weights.dtype,
        receivers=tuple(map(str, identity.all_of(Role.POLICY, config.policy.num_replicas))),
        workers_per_receiver=config.policy.tensor_parallel_size)

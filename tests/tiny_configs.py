"""The tiny model's engine and trainer settings, for tests that build an actor's config directly.

The schema's defaults suit a 1-8B model (bf16, long completions); a test of the tiny BlackJack
model wants what the library's defaults were before that: one float32 token constrained to the
action words, and every sample in one micro-batch. ``jobs/configs/blackjack_tiny.yaml`` sets the
same for the demo.
"""

from ray_forge.config.schema import GRPOConfig, PolicyConfig, TrainerConfig

TINY_POLICY = dict(max_tokens=1, constrain_to_actions=True, draw_from_distribution=True, max_model_len=128,
                   kv_cache_mb=256, dtype="float32", enforce_eager=True)
TINY_TRAINER = dict(lr=3e-5, micro_batch_size=4096, dtype="float32")
TINY_GRPO = dict(entropy_coef=0.01)


def policy(**changes) -> PolicyConfig:
    return PolicyConfig(**{**TINY_POLICY, **changes})


def trainer(**changes) -> TrainerConfig:
    return TrainerConfig(**{**TINY_TRAINER, **changes})


def grpo(**changes) -> GRPOConfig:
    return GRPOConfig(**{**TINY_GRPO, **changes})

"""Supervised fine-tuning on the GRPO job's TorchTitan ranks (FSDP2; gloo on CPU, NCCL on GPU).

    python jobs/sft.py --config jobs/configs/sft_tools_tiny.yaml data.train=conversations.jsonl
    python jobs/sft.py --resume runs/sft-tiny-20261202-101500        # after a kill: exact
    python jobs/grpo.py --config ... model.path=runs/sft-tiny-20261202-101500/final_model

Conversations (``{"messages": [...], "tools": [...]}``, JSONL or Parquet) are rendered by the
model's chat template through the rollouts' sequence builder, loss on assistant tokens only
(``ray_forge/core/sft.py``), and packed. Each step trains on ``data.batch_size`` conversations;
the held-out loss is logged every ``run.eval_every`` steps, every row to ``metrics.jsonl``; a
checkpoint every ``run.checkpoint_every`` steps; the result is ``final_model``, an HF folder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import ray

from ray_forge.actors.launch import chat_tokenizer, start_trainer_ranks
from ray_forge.actors.trainer_group import TrainerGroup
from ray_forge.cluster import pools
from ray_forge.config import ConfigError
from ray_forge.config.schema import SFTConfig
from ray_forge.core import sft
from ray_forge.core.cadence import every
from ray_forge.core.chat import ChatFormat
from ray_forge.core.checkpoint import CheckpointError, CheckpointManager
from ray_forge.models.export import save_hf_folder
from ray_forge.models.tiny import ModelError
from ray_forge.observe.metrics import MetricsLog, open_metrics
from ray_forge.remote import RemoteCallError
from ray_forge.run.command_line import parse_args, run_cli, stops_resumably
from ray_forge.run.directory import FINISHED_FILE, Run, base_model, create, open_run, run_namespace, start_point
from ray_forge.run.recorder import Progress

log = logging.getLogger("sft")

FIXED_ON_RESUME = ("run.seed", "data.train", "data.eval", "data.eval_fraction", "data.batch_size", "data.max_tokens",
                   "data.pack", "trainer.num_ranks", "model.path", "model.tiny")
"""What a resumed run keeps from its saved config: the batches and shards depend on it."""


def corpus_of(conversations: list[sft.Conversation]) -> list[str]:
    """What a tiny tokenizer is trained on: the messages, their tool calls and the tool schemas."""
    texts = [json.dumps(c.tools) for c in conversations if c.tools]
    return texts + [m["content"] + json.dumps(m.get("tool_calls") or "") for c in conversations for m in c.messages]


def rows_of(tokenizer, conversations: list[sft.Conversation]) -> list[list[sft.Row]]:
    """Each conversation's rows (one, or one per segment)."""
    return [sft.render(tokenizer, c) for c in conversations]


def step_rows(config: SFTConfig, rows: list[list[sft.Row]], step: int) -> list[sft.Packed]:
    """The packed rows of training step ``step``."""
    chosen = [row for i in sft.batch_of(len(rows), config.data.batch_size, step, config.run.seed) for row in rows[i]]
    return as_packed(config, chosen)


def as_packed(config: SFTConfig, rows: list[sft.Row]) -> list[sft.Packed]:
    return sft.pack(rows, config.data.max_tokens, together=config.data.pack)


async def train(config: SFTConfig, trainer: TrainerGroup, checkpoints: CheckpointManager, progress: Progress,
                metrics: MetricsLog, train_rows, eval_rows) -> dict:
    held_out = ray.put(eval_rows) if eval_rows else None
    row: dict = {}
    for step in range(progress.step + 1, config.run.steps + 1):
        start = time.monotonic()
        packed = step_rows(config, train_rows, step)
        row = await trainer.sft_step(ray.put(packed))
        row.update(rows=len(packed), loss_tokens=sum(p.loss_tokens for p in packed),
                   tokens=sum(len(p.token_ids) for p in packed))
        if held_out is not None and every(config.run.eval_every, step, config.run.steps):
            row["eval_loss"] = await trainer.sft_eval(held_out)
        progress.step, progress.row = step, row  # a kill before the row is logged leaves it to the resumed run
        if (saved_s := await checkpoints.save(step, last_step=step == config.run.steps)) is not None:
            row["checkpoint_s"] = saved_s
        row["step_time_s"] = time.monotonic() - start
        metrics.log(step, **row)
        metrics.advance(loss=row["loss"], eval_loss=row.get("eval_loss"))
    return row


async def run_job(run: Run, model_dir: str, train_rows, eval_rows, tool_tags: str) -> dict:
    config, run_dir = run.config, run.run_dir
    checkpoints = CheckpointManager(run_dir, config.run.checkpoint_every, config.run.keep_checkpoints, run.resume_from)
    progress = Progress(weights_version=False)
    checkpoints.add(progress=progress)
    saved, wall_s = start_point(run, checkpoints)
    started_ray = pools.connect(config.cluster, namespace=run_namespace(run))
    placement = pools.Pools(config.cluster, {config.trainer.resources.pool: [("trainer", config.trainer.resources)]
                                             * config.trainer.num_ranks})
    ranks = start_trainer_ranks(config.trainer, placement.slots["trainer"], model_dir, config.run.steps)
    trainer = TrainerGroup(ranks, config.trainer.call_timeout_s)
    try:
        num_params = trainer.setup()
        log.info("%d trainer ranks, %.2fM params, %d train and %d held-out conversations", len(ranks),
                 num_params / 1e6, len(train_rows), len(eval_rows))
        await checkpoints.attach(saved, trainer=trainer)
        metrics = open_metrics(run_dir, config, progress.step, wall_s, desc="SFT")
        try:
            last = await train(config, trainer, checkpoints, progress, metrics, train_rows,
                               held_out_packed(config, eval_rows))
        finally:
            metrics.close()
        await save_hf_folder(trainer, model_dir, run_dir / "final_model", config.run.steps, config.trainer.dtype)
        summary = dict(run_dir=str(run_dir), final_model=str(run_dir / "final_model"), steps=config.run.steps,
                       loss=last.get("loss"), eval_loss=last.get("eval_loss"), tool_tags=tool_tags)
        (run_dir / FINISHED_FILE).write_text(json.dumps(summary, indent=2))
        log.info("final model: %s", run_dir / "final_model")
        return summary
    finally:
        trainer.shutdown()
        for rank in ranks:
            ray.kill(rank, no_restart=True)
        placement.release()
        if started_ray:
            ray.shutdown()


def held_out_packed(config: SFTConfig, eval_rows: list[list[sft.Row]]) -> list[sft.Packed]:
    return as_packed(config, [row for rows in eval_rows for row in rows]) if eval_rows else []


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, str(Path(__file__).parent / "configs" / "sft_tools_tiny.yaml"), argv,
                      "trainer.lr=1e-3 run.steps=50")
    run = open_run(args.config, args.overrides, args.resume, cls=SFTConfig, fixed=FIXED_ON_RESUME)
    config = run.config
    if not config.data.train:
        raise ConfigError("data.train is empty: give a JSONL or Parquet file of conversations")
    conversations = sft.load_conversations(config.data.train)
    if config.data.eval:
        train_set, eval_set = conversations, sft.load_conversations(config.data.eval)
    else:
        train_set, eval_set = sft.split(conversations, config.data.eval_fraction, config.run.seed)
    create(run)
    model_dir = base_model(run, lambda: corpus_of(train_set), chat=True)
    tokenizer = chat_tokenizer(model_dir)
    start = time.monotonic()
    train_rows, eval_rows = rows_of(tokenizer, train_set), rows_of(tokenizer, eval_set)
    log.info("rendered %d conversations in %.1f s", len(train_set) + len(eval_set), time.monotonic() - start)
    with stops_resumably(run, "jobs/sft.py", (RemoteCallError, CheckpointError, TimeoutError)):
        summary = asyncio.run(run_job(run, model_dir, train_rows, eval_rows, ChatFormat(tokenizer).tool_tags))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_cli(main, "sft", (ModelError, sft.DataError))

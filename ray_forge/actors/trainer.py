"""Trainer actor: one FSDP2 rank of TorchTitan's Qwen3 (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ray_forge.config.schema import GRPOConfig, TrainerConfig
from ray_forge.core.algorithm import TOKEN_STATS as STATS
from ray_forge.core.algorithm import grpo_loss, loss_normalizer, sft_loss, token_logprobs_and_entropy
from ray_forge.core.batch import PackedBatch, TensorBatch, collate, collate_packed, inputs_together, sampled_logprobs
from ray_forge.core.checkpoint import TRAINER_DIR, rank_file
from ray_forge.core.episode import Sample, Scored
from ray_forge.models.devices import require_dtype
from ray_forge.models.decoder import build_sharded_decoder, full_hf_state_dict
from ray_forge.net import free_port
from ray_forge.weights import StoreSpec, WeightStore

log = logging.getLogger(__name__)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port for the process group's rendezvous."""
    return ray.util.get_node_ip_address(), free_port("")


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TitanTrainer:
    """One rank. ``setup`` joins the process group and shards the model; ``train_step`` takes
    the whole batch and uses its rank's rows; ``export_hf`` gathers full weights (all ranks)."""

    def __init__(self, config: TrainerConfig, *, grpo: GRPOConfig, model_dir: str, total_steps: int, rank: int,
                 allowed_token_ids: list[int] | None, temperature: float = 1.0) -> None:
        self.model_dir, self.cfg, self.grpo = model_dir, config, grpo
        self.total_steps, self.rank, self.world_size = total_steps, rank, config.num_ranks
        self.allowed = torch.tensor(allowed_token_ids) if allowed_token_ids else None
        self.temperature = temperature
        self.device = device_type()
        self.version = 0
        torch.set_num_threads(config.resources.torch_threads)
        self.model = self.adapter = self.optimizer = self.scheduler = None
        self._head_rows: torch.Tensor | None = None
        """Set during ``_forward_at``: the positions the output head is applied at."""
        self._forward_rows = 0
        """The rows ``_forward_at`` ran in this step: the distinct inputs of each micro-batch."""
        self.average: dict[str, torch.Tensor] | None = None
        """The moving average of the weights (``trainer.ema_decay``), sharded like them."""
        self.store: WeightStore | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        return free_address()

    def setup(self, master_addr: str, master_port: int) -> int:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", rank=self.rank,
                                world_size=self.world_size)
        require_dtype(self.cfg.dtype, self.device, "trainer.dtype")
        self.model, self.adapter = build_sharded_decoder(self.model_dir, self.world_size, self.device, self.cfg.dtype)
        self.model.lm_head.register_forward_pre_hook(self._head_only_at_rows)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, self.total_steps, self.cfg.warmup_steps, self.cfg.min_lr_ratio))
        if self.cfg.ema_decay:
            self.average = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        return sum(p.numel() for p in self.model.parameters()) * self.world_size

    def train_step(self, samples: list[Sample], ref_logprobs: list[tuple[float, ...]] | None = None) -> dict[str, float]:
        """One optimizer step on the GRPO loss; returns this rank's share of each statistic.

        ``ref_logprobs``: the reference model's, one tuple per sample, for the KL term (the buffer
        and the reference model hand both over as object references, which Ray resolves here).
        An empty batch (every group without signal) changes no weight, but the version and the
        LR schedule still advance: the version is the step, and the checkpoint records it."""
        if ref_logprobs is not None:
            samples = [dataclasses.replace(s, ref_logprobs=r) for s, r in zip(samples, ref_logprobs, strict=True)]
        if not samples:
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self._average_in()
            self.version += 1
            return dict(loss=0.0, **dict.fromkeys(STATS, 0.0), num_tokens=0.0, forward_rows=0.0,
                        grad_norm=0.0, lr=lr, version=self.version, skipped_nonfinite=0.0)
        samples = inputs_together(samples)
        full = collate(samples)
        normalizer = loss_normalizer(full.mask_BT, full.weights_B, self.grpo.token_aggregation)
        rows = self._my_rows(len(samples))
        mine = collate([samples[i] for i in rows])
        if len(rows) < self._rows_per_rank(len(samples)):  # equal work on every rank: FSDP collectives
            mine = _with_padding_row(mine)
        sums = dict(loss=0.0, **dict.fromkeys(STATS, 0.0))
        num_tokens = float((mine.mask_BT * mine.weights_B[:, None]).sum())
        self._forward_rows = 0
        for start in range(0, mine.inputs_BT.shape[0], self.cfg.micro_batch_size):
            micro = _slice(mine, start, start + self.cfg.micro_batch_size).to(self.device)
            terms = self._loss(micro, normalizer)
            terms.loss.backward()
            micro_tokens = float((micro.mask_BT * micro.weights_B[:, None]).sum())
            sums["loss"] += terms.loss.item()
            for key in STATS:
                sums[key] += getattr(terms, key).item() * micro_tokens
        from torchtitan.distributed import utils as dist_utils

        grad_norm = float(dist_utils.clip_grad_norm_(list(self.model.parameters()), self.cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        # The norm is all-reduced, so every rank takes the same decision. A NaN or inf loss or
        # gradient would poison the weights and the optimizer's moments for good: skip the
        # update, keep the schedule and the version count moving, and report it.
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("step %d skipped: gradient norm is %s (loss %s)", self.version + 1, grad_norm, sums["loss"])
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._average_in()
        self.version += 1
        return dict(sums, num_tokens=num_tokens, forward_rows=float(self._forward_rows), grad_norm=grad_norm, lr=lr,
                    version=self.version, skipped_nonfinite=float(skipped))

    @torch.no_grad()
    def _average_in(self) -> None:
        """One step of the moving average (every step, an empty one too: the average is over steps)."""
        if self.average is not None:
            for name, param in self._sharded_parameters():
                self.average[name].lerp_(param.detach(), 1.0 - self.cfg.ema_decay)

    @torch.no_grad()
    def use_average(self) -> None:
        """The weights become their moving average (the run's end: what the engines load next and
        what an export writes)."""
        if self.average is None:
            raise RuntimeError("use_average needs trainer.ema_decay > 0: no average was kept")
        for name, param in self._sharded_parameters():
            param.copy_(self.average[name])

    def _sharded_parameters(self):
        """The parameters as FSDP2 shards them. A forward without backward (a sync check) leaves
        the root module's parameters gathered, as plain tensors; resharding first also makes the
        next forward gather what was written here."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return self.model.named_parameters()

    def _forward_at(self, inputs_DT: torch.Tensor, rows_DT: torch.Tensor) -> torch.Tensor:
        """The model's logits at ``rows_DT``'s positions only (``sampled_logprobs``' forward)."""
        self._head_rows = rows_DT
        self._forward_rows += len(inputs_DT)  # distinct inputs: what the step's forwards cost
        try:
            return self.model(inputs_DT)
        finally:
            self._head_rows = None

    def _head_only_at_rows(self, module, args):
        # Inside the model's forward, where FSDP has gathered the head's weight: it sees the
        # hidden states of the chosen positions only.
        return None if self._head_rows is None else (args[0][self._head_rows],)

    def _loss(self, micro: TensorBatch, normalizer: torch.Tensor):
        logprobs_BT, entropy_BT, *actions = sampled_logprobs(self._forward_at, micro.inputs_BT, micro.targets_BT,
                                                             micro.mask_BT, self.allowed, self.temperature,
                                                             with_actions=self.grpo.center_actions)
        return grpo_loss(
            logprobs_BT, micro.behaviour_logprobs_BT, micro.advantages_B, micro.mask_BT,
            clip_eps=self.grpo.clip_eps, weights_B=micro.weights_B,
            ref_logprobs_BT=micro.ref_logprobs_BT, kl_coef=self.grpo.kl_coef,
            entropy_BT=entropy_BT, entropy_coef=self.grpo.entropy_coef,
            aggregation=self.grpo.token_aggregation, normalizer=normalizer.to(self.device),
            tis_cap=self.grpo.tis_cap, actions=actions[0] if actions else None,
        )

    def sft_step(self, rows: list) -> dict[str, float]:
        """One optimizer step on the supervised loss of packed rows (``ray_forge.core.sft``): every
        rank sees the whole batch, trains on its share of rows and divides by the batch's loss
        tokens. Returns this rank's share of the loss, and the step's grad norm and lr."""
        loss = self._sft_backward(rows, train=True)
        from torchtitan.distributed import utils as dist_utils

        grad_norm = float(dist_utils.clip_grad_norm_(list(self.model.parameters()), self.cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("SFT step %d skipped: gradient norm is %s", self.version + 1, grad_norm)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return dict(loss=loss, grad_norm=grad_norm, lr=lr, version=self.version, skipped_nonfinite=float(skipped))

    def sft_eval(self, rows: list) -> float:
        """This rank's share of the supervised loss of ``rows``, with no update (held-out loss)."""
        with torch.no_grad():
            return self._sft_backward(rows, train=False)

    def _sft_backward(self, rows: list, train: bool) -> float:
        normalizer = float(max(1, sum(r.loss_tokens for r in rows)))
        mine = [rows[i] for i in self._my_rows(len(rows))]
        # Equal work on every rank (FSDP collectives): a rank short of rows runs a copy with no loss.
        padding = [dataclasses.replace(rows[0], loss_mask=(0,) * len(rows[0].loss_mask))]
        mine += padding * (self._rows_per_rank(len(rows)) - len(mine))
        total = 0.0
        for start in range(0, len(mine), self.cfg.micro_batch_size):
            micro = collate_packed(mine[start:start + self.cfg.micro_batch_size]).to(self.device)
            loss = self._packed_loss(micro, normalizer)
            if train:
                loss.backward()
            total += loss.item()
        return total

    def _packed_loss(self, micro: PackedBatch, normalizer: float) -> torch.Tensor:
        logits_BTV = self.model(micro.inputs_BT, positions=micro.positions_BT, attention_masks=micro.attention_B1TT)
        return sft_loss(logits_BTV, micro.targets_BT, micro.mask_BT, normalizer)

    def export_hf(self, out_dir: str | None) -> str | None:
        """Gather full weights in HF naming; rank 0 writes ``model.safetensors`` into ``out_dir``,
        in the training dtype (bf16 training exports bf16: half the bytes, what the engines load)."""
        state = full_hf_state_dict(self.model, self.adapter)
        if self.rank != 0 or out_dir is None:
            return None
        from safetensors.torch import save_file

        dtype = getattr(torch, self.cfg.dtype)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_file(state, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
        return out_dir

    def save_checkpoint(self, folder: str) -> float:
        """Model and optimizer shards through torch.distributed.checkpoint (every rank writes its
        own), and this rank's LR schedule, version and RNG state. Returns seconds."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        start = time.monotonic()
        state = {"model": self.model.state_dict(), "optim": get_optimizer_state_dict(self.model, self.optimizer),
                 **({"average": self.average} if self.average is not None else {})}
        dcp.save(state, checkpoint_id=str(Path(folder) / TRAINER_DIR))
        torch.save(dict(scheduler=self.scheduler.state_dict(), version=self.version, rng=torch.get_rng_state()),
                   Path(folder) / rank_file(self.rank))
        return time.monotonic() - start

    def load_checkpoint(self, folder: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote, in place (after ``setup``); returns the version."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        # Asking for the optimizer's state dict first creates its (empty) moments, which the load then fills.
        state = {"model": self.model.state_dict(), "optim": get_optimizer_state_dict(self.model, self.optimizer),
                 **({"average": self.average} if self.average is not None else {})}  # loaded in place
        dcp.load(state, checkpoint_id=str(Path(folder) / TRAINER_DIR))
        # TorchTitan's fused QKV shows wq/wk/wv in the state dict as copies, not views of the
        # parameter: loading in place misses them, load_state_dict fuses them back.
        self.model.load_state_dict(state["model"], strict=True)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        extra = torch.load(Path(folder) / rank_file(self.rank), weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        self.version = extra["version"]
        return self.version

    def publish_weights(self, spec: StoreSpec, version: int) -> float:
        """Put this rank's own shards of the weights in the weight store, in HF naming with their
        place in each whole tensor: no rank gathers the model. Returns seconds.

        The version is published once every rank has put its part. The driver runs this together
        with the engines' sync (``Fleet.sync``): over some transports the put streams into them."""
        from ray_forge.weights.shards import local_hf_pieces

        start = time.monotonic()
        if self.store is None or self.store.spec != spec:
            self.store = WeightStore(spec)
        self.store.put_shards(version, local_hf_pieces(self.model, self.adapter), rank=self.rank,
                              num_ranks=self.world_size)
        return time.monotonic() - start

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def score(self, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[Scored]:
        """For each (prompt, response): the logprob of every response token under the
        distribution the engine samples from (allowed tokens, temperature), and the argmax
        token at the first response position. Every rank runs the same forwards (FSDP)."""
        out = []
        with torch.no_grad():
            for start in range(0, len(pairs), self.cfg.micro_batch_size):
                out += self._score_chunk(pairs[start:start + self.cfg.micro_batch_size])
        return out

    def _score_chunk(self, pairs) -> list[Scored]:
        sequences = [list(p) + list(r) for p, r in pairs]
        width = max(len(s) for s in sequences) - 1
        inputs = torch.zeros(len(pairs), width, dtype=torch.long)
        for row, seq in enumerate(sequences):  # right padding: a causal model never looks ahead
            inputs[row, :len(seq) - 1] = torch.tensor(seq[:-1])
        logits_BTV = self.model(inputs.to(self.device)).float().cpu()
        scored = []
        for row, (prompt, response) in enumerate(pairs):
            positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
            logits_TV = logits_BTV[row, positions]
            logprobs, _ = token_logprobs_and_entropy(logits_TV[None], torch.tensor([response]), self.allowed,
                                                      self.temperature)
            first = logits_TV[0]
            argmax = (int(self.allowed[first[self.allowed].argmax()]) if self.allowed is not None
                      else int(first.argmax()))
            scored.append(Scored(tuple(logprobs[0].tolist()), argmax))
        return scored

    def logits(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Full-vocabulary logits of equal-length rows (for checks against the policy engine)."""
        with torch.no_grad():
            return self.model(torch.tensor(token_ids, device=self.device)).float().cpu()

    def _rows_per_rank(self, num_rows: int) -> int:
        return -(-num_rows // self.world_size)

    def _my_rows(self, num_rows: int) -> list[int]:
        return list(range(self.rank, num_rows, self.world_size))

    def shutdown(self) -> None:
        # Shared-memory versions live on this node, which may not be the driver's; push groups end here.
        if self.store is not None:
            self.store.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _slice(batch: TensorBatch, start: int, end: int) -> TensorBatch:
    return TensorBatch(**{k: v[start:end] if v is not None else None for k, v in batch.__dict__.items()})


_NO_LOSS_FIELDS = ("mask_BT", "advantages_B", "weights_B")


def _with_padding_row(batch: TensorBatch) -> TensorBatch:
    """Append a copy of row 0 with no loss, so this rank runs as many forwards as the others."""
    def pad(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        extra = value[:1].clone()
        if name in _NO_LOSS_FIELDS:
            extra.zero_()
        return torch.cat([value, extra])
    return TensorBatch(**{k: pad(k, v) for k, v in batch.__dict__.items()})


TrainerActor = ray.remote(TitanTrainer)

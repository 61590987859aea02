"""Reference actor: the frozen initial model, scoring samples for the KL penalty."""

from __future__ import annotations

import ray
import torch

from ray_forge.config.schema import ReferenceConfig
from ray_forge.core.algorithm import token_logprobs_and_entropy
from ray_forge.core.batch import collate, response_logprobs
from ray_forge.core.episode import Sample
from ray_forge.models.decoder import build_decoder


class ReferenceModel:
    """TorchTitan's Qwen3 with the starting weights, forward only, no sharding."""

    def __init__(self, config: ReferenceConfig, *, model_dir: str, allowed_token_ids: list[int] | None,
                 temperature: float = 1.0, micro_batch_size: int = 4096) -> None:
        torch.set_num_threads(config.resources.torch_threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, _ = build_decoder(model_dir, self.device)
        self.model.eval()
        self.allowed = torch.tensor(allowed_token_ids) if allowed_token_ids else None
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[tuple[float, ...]]:
        """Reference logprob of every response token, same layout as the behaviour logprobs."""
        out: list[tuple[float, ...]] = []
        for start in range(0, len(samples), self.micro_batch_size):
            batch = collate(samples[start:start + self.micro_batch_size]).to(self.device)
            logits_BTV = self.model(batch.inputs_BT)
            logprobs_BT, _ = token_logprobs_and_entropy(logits_BTV, batch.targets_BT, self.allowed,
                                                        self.temperature)
            out.extend(response_logprobs(batch.to("cpu"), logprobs_BT.cpu()))
        return out


ReferenceActor = ray.remote(ReferenceModel)

"""What a run keeps besides its checkpoints: where it is (``Progress``), and every evaluation with
the best policy so far (``Recorder``). Both are parts of the checkpointed driver state."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from ray_forge.models.export import SAVED_STEP, save_hf_folder
from ray_forge.run.directory import EVALUATIONS_DIR

log = logging.getLogger(__name__)

BEST_POLICY = "best_policy"


class Progress:
    """The last step done, and its metrics row (written again on resume if the kill came before it was)."""

    def __init__(self, weights_version: bool = True) -> None:
        self.step, self.row = 0, {}
        self.weights_version = weights_version
        """Whether the checkpoint says which policy version it holds (GRPO's: the step's)."""

    def state_dict(self) -> dict[str, Any]:
        return dict(row=self.row, **({"policy_version": self.step} if self.weights_version else {}))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.row = state["step"], state.get("row") or {}


class Recorder:
    """Each evaluation's whole result in ``evaluations/step-<N>.json`` and its row in ``evals``; with
    ``keep_best``, the trainer's weights as ``best_policy`` when its evaluation is the best yet."""

    def __init__(self, run_dir: Path, trainer_dtype: str, keep_best: bool) -> None:
        self.run_dir, self.dtype, self.keep_best = run_dir, trainer_dtype, keep_best
        self.best: dict = {}
        self.evals: list[dict] = []
        self.trainer = self.model_dir = None

    def attach(self, trainer, model_dir: str) -> None:
        """The trainer group the policies are saved from, and the base model their config comes from."""
        self.trainer, self.model_dir = trainer, model_dir

    def state_dict(self) -> dict[str, Any]:
        return dict(best=self.best, evals=self.evals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.evals = state["best"], state["evals"]
        best = self.run_dir / BEST_POLICY
        if best.is_dir() and json.loads((best / SAVED_STEP).read_text())["step"] != self.best.get("step"):
            log.warning("%s holds weights of a step after the checkpoint: removed (the next better evaluation "
                        "saves it again)", best)
            shutil.rmtree(best)

    async def keep(self, step: int, result: dict, row: dict) -> None:
        folder = self.run_dir / EVALUATIONS_DIR
        folder.mkdir(exist_ok=True)
        (folder / f"step-{step:05d}.json").write_text(json.dumps(result, indent=1))
        self.evals.append(dict(row, step=step))
        # The best policy is saved from the trainer: only an evaluation of the same weights may pick it.
        if (self.keep_best and step and row["eval_policy_version"] == step
                and row["eval_return"] > self.best.get("eval_return", float("-inf"))):
            self.best = dict(row, step=step)
            await self.save_policy(BEST_POLICY, step)

    async def save_policy(self, name: str, step: int) -> Path:
        """The trainer's weights as a self-contained HF folder ``name`` in the run directory."""
        out_dir = self.run_dir / name
        await save_hf_folder(self.trainer, self.model_dir, out_dir, step, self.dtype)
        return out_dir

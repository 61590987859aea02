"""The tool demo: a tiny model learns to use the python tool, on the local default (`make demo-tools`).

1. Demonstrations of ``a * b + c`` questions (``envs/code/arithmetic.py``): some call the tool and
   copy its output, some make a call that fails and then guess, the rest guess.
2. ``jobs/sft.py`` warm-starts a tiny chat model on them.
3. ``jobs/grpo.py`` trains it with the python tool in the loop (the local sandbox), evaluating the
   held-out questions before the first step and every ``run.eval_every`` steps.

    python jobs/demo_tools.py                      # seed 0
    python jobs/demo_tools.py --seed 1 --sft-from runs/demo-tools-0/sft    # another GRPO seed, same start
    python jobs/demo_tools.py --refuse-tools       # the ablation: every tool call answered with an error
    python jobs/demo_tools.py --model smollm2      # the same path for SmolLM2-135M-Instruct (make demo-tools MODEL=smollm2)

Prints one JSON line: where the held-out pass rate started and ended, and the run directories.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from envs.code.arithmetic import Mix, demonstrations

ROOT = Path(__file__).resolve().parent
# model -> (the SFT job's config, the GRPO job's config); both configs name the model to start from.
CONFIGS = {
    "tiny": (ROOT / "configs" / "sft_tools_tiny.yaml", ROOT / "configs" / "arith_tools_tiny.yaml"),
    "smollm2": (ROOT / "configs" / "sft_tools_smollm2.yaml", ROOT / "configs" / "arith_tools_smollm2.yaml"),
}
log = logging.getLogger("demo-tools")


def write_demonstrations(out: Path, seed: int, mix: Mix, grpo_config: Path) -> Path:
    """The warm start's conversations, of the GRPO job's train split only (its held-out split stays unseen)."""
    from envs import registry
    from ray_forge.config import load_config
    from ray_forge.config.schema import JobConfig

    train, _ = registry.setup(load_config(JobConfig, grpo_config).env).options.arithmetic.splits()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(c) + "\n" for c in demonstrations(train, mix, seed)))
    return out


def starting_model(model: str) -> list[str]:
    """The SFT job's overrides that name the model it starts from: none for the tiny model (its
    config builds one), the wheel's GGUF converted once for SmolLM2 (the folder `make demo-real` uses)."""
    if model == "tiny":
        return []
    from ray_forge.models.gguf import convert, smollm2_gguf

    return [f"model.path={convert(smollm2_gguf(), ROOT.parent / 'models' / 'smollm2-135m')}"]


def tool_use(row: dict) -> dict:
    """An evaluation's reading of the tool, greedy and sampled: episodes with a well-formed call,
    calls per episode, and the share of calls that failed."""
    out = {}
    for mode, prefix in (("greedy", "eval_"), ("sampled", "eval_sampled_")):
        calls = row.get(f"{prefix}tool_calls", 0.0)
        out[mode] = dict(called=row.get(f"{prefix}called"), calls_per_episode=calls,
                         failed_calls=row.get(f"{prefix}tool_errors", 0.0) / calls if calls else None)
    return out


def job(script: str, *argv: str) -> dict:
    """Run a job script in its own process (its own Ray cluster), its log on this one's stderr;
    returns the summary it prints last."""
    done = subprocess.run([sys.executable, str(ROOT / script), *argv], stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{script} failed (exit {done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="tiny",
                        help="tiny: a random-init chat model made here; smollm2: SmolLM2-135M-Instruct from its wheel")
    parser.add_argument("--seed", type=int, default=0, help="seeds the demonstrations, the SFT and the GRPO run")
    parser.add_argument("--out", default="runs", help="where the run directories go")
    parser.add_argument("--sft-from", help="a finished SFT run directory to start GRPO from (skips steps 1-2)")
    parser.add_argument("--refuse-tools", action="store_true", help="the ablation: tool calls are refused")
    parser.add_argument("grpo_overrides", nargs="*", help="dotted overrides of the GRPO run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start = time.monotonic()
    out = Path(args.out).resolve()
    sft_config, grpo_config = CONFIGS[args.model]
    tag = "" if args.model == "tiny" else f"-{args.model}"
    if args.sft_from:
        sft_dir = Path(args.sft_from).resolve()
    else:
        demos = write_demonstrations(out / f"demo-tools{tag}-{args.seed}-demonstrations.jsonl", args.seed, Mix(), grpo_config)
        sft_dir = Path(job("sft.py", "--config", str(sft_config), f"data.train={demos}", f"run.seed={args.seed}",
                           f"run.output_dir={out}", f"run.name=demo-tools{tag}-sft-{args.seed}",
                           *starting_model(args.model))["run_dir"])
    sft_s = time.monotonic() - start
    name = f"demo-tools{tag}-grpo-{args.seed}" + ("-refused" if args.refuse_tools else "")
    summary = job("grpo.py", "--config", str(grpo_config), f"model.path={sft_dir / 'final_model'}",
                  f"run.seed={args.seed}", f"run.output_dir={out}", f"run.name={name}",
                  f"env.episode.tools.refuse={str(args.refuse_tools).lower()}", *args.grpo_overrides)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_sampled_solved" in r]
    result = dict(model=args.model, seed=args.seed, refused=args.refuse_tools, sft_dir=str(sft_dir), grpo_dir=summary["run_dir"],
                  start_sampled=evals[0]["eval_sampled_solved"], start_greedy=evals[0]["eval_solved"],
                  end_sampled=summary.get("sampled_solved"), end_greedy=summary.get("solved"),
                  start=tool_use(evals[0]), end=tool_use(evals[-1]),
                  sft_s=round(sft_s, 1), total_s=round(time.monotonic() - start, 1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except Exception as err:  # the jobs' own errors are one line already
        print(f"demo-tools: error: {err}", file=sys.stderr)
        sys.exit(1)

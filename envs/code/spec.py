"""The code env as a plugin: its options (``env.options``), the envs it makes, its tokenizer
texts, its greedy evaluation and its pictures."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from envs.code.arithmetic import Arithmetic
from envs.code.env import CodeEnv, show
from envs.code.python_tool import SCHEMA, ReplaySession
from envs.code.sandbox import Limits, LocalSandbox
from envs.code.tasks import BUNDLED, Task, load_tasks
from ray_forge.core.env import Decide, EnvMaker, EnvSpec, PlayEpisodes
from ray_forge.observe.plots import learning_curve_png, tool_use_png

HTTP_SLACK_S = 30.0
"""Added to Together's own wall-time limit for a cell: the HTTP round trip, so its limit fires first."""


@dataclass(frozen=True, kw_only=True)
class CodeOptions:
    """The code env (``env.name: code``): the model writes Python, tests give the reward."""

    tasks: str = ""
    """A JSONL or Parquet file of tasks in any format ``envs/code/tasks.py`` reads (native, assert tests,
    stdin/stdout cases, call/expected lists); empty: the bundled set."""
    backend: Literal["local", "together"] = "local"
    """local: the sandbox on the env actor's node; together: Together's Code Interpreter
    (TOGETHER_API_KEY from the environment or a Kubernetes Secret)."""
    concurrency: int = 2
    """Executions at once per env actor (sandbox interpreters, or requests in flight); with the
    python tool, every game in play has a thread, and the sandbox still runs this many at once."""
    isolation: Literal["full", "none"] = "full"
    """local backend: full (namespaces, read-only root, seccomp, limits; the sandbox refuses to
    start where the kernel or container cannot give it, saying what is missing) or none (limits
    only: executed code can do what the env actor's user can; a developer's own machine only)."""
    limits: Limits = field(default_factory=Limits)
    """What one execution may use (``envs/code/sandbox.py``); Together's interpreter gets
    ``limits.wall_s`` plus 30 s per request."""
    tool: bool = False
    """Offer the ``python`` tool: the model may run code, one interpreter session per episode,
    before it answers (needs ``env.episode.mode: sequence``)."""
    arithmetic: Arithmetic = field(default_factory=Arithmetic)
    """Generated ``a * b + c`` questions with a held-out split (``envs/code/arithmetic.py``) instead
    of ``tasks``, when ``arithmetic.train`` > 0."""
    eval_sampled: bool = False
    """The evaluation also plays each task once sampled, at the policy's temperature
    (``sampled_solved``): a warm-started policy's greedy choice can hide what it samples."""

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 16:
            raise ValueError(f"concurrency = {self.concurrency} is out of range: a sandbox has 1 to 16 interpreters")
        if self.tool and self.backend == "local" and self.isolation != "full":
            raise ValueError("tool = true needs isolation = full: the model reads what its code prints, so with "
                             "isolation none it could read this machine's files and environment and see them")
        for name, value in vars(self.limits).items():
            if not value > 0:
                raise ValueError(f"limits.{name} = {value!r} is out of range: it must be > 0")

    def task_list(self) -> list[Task]:
        """The tasks the rollouts are dealt: generated, the file in ``tasks``, or the bundled set."""
        if self.arithmetic.train:
            return self.arithmetic.splits()[0]
        return load_tasks(self.tasks or BUNDLED)

    def eval_list(self) -> list[Task]:
        """The tasks the evaluation shows: the held-out split of generated ones, else the same tasks."""
        if self.arithmetic.train:
            return self.arithmetic.splits()[1]
        return self.task_list()


def make_envs(options: CodeOptions, invalid_action_penalty: float) -> EnvMaker:
    """A maker of CodeEnvs: local ones share one sandbox pool (``concurrency`` interpreters, which
    refuses to start without the ``isolation`` asked for); Together ones each get their own client,
    so each episode has its own session."""
    tasks, held_out = options.task_list(), options.eval_list()
    if options.backend == "together":
        from envs.code.together_interpreter import TogetherCodeInterpreter

        def interpreter() -> TogetherCodeInterpreter:
            return TogetherCodeInterpreter(timeout_s=options.limits.wall_s + HTTP_SLACK_S)

        # The answer is judged in a session of its own, never in the one the model's calls shaped.
        return EnvMaker(lambda: CodeEnv(tasks, interpreter(), session=interpreter() if options.tool else None,
                                        held_out=held_out))
    sandbox = LocalSandbox(size=options.concurrency, limits=options.limits, isolation=options.isolation)
    return EnvMaker(lambda: CodeEnv(tasks, sandbox, session=ReplaySession(sandbox) if options.tool else None,
                                    held_out=held_out), sandbox.close)


def prompts(options: CodeOptions) -> list[str]:
    """Every task's prompt, as the env shows it (showing one runs nothing); of generated ones, 64."""
    return [show(task, options.tool) for task in options.task_list()[:64] + options.eval_list()[:64]]


def corpus(options: CodeOptions) -> list[str]:
    """The prompts, and the tests written as Python (``gcd(12, 18) == 6``)."""
    tests = [f"{task.entry_point}({', '.join(map(repr, call.args))}) == {call.expected!r}"
             for task in options.task_list() for call in task.tests]
    calls = [json.dumps({"name": "python", "arguments": {"code": code}}) for code in ("x = 1", "print(x)")]
    return prompts(options) + tests + (calls + [json.dumps(SCHEMA)] if options.tool else [])


def evaluate(options: CodeOptions, decide: Decide, make_env: EnvMaker, *, play: PlayEpisodes,
             invalid_action_penalty: float, final: bool) -> tuple[dict[str, float], dict]:
    """The greedy episode of every evaluation task (the held-out split, or every task; seed
    ``-1 - i`` shows task ``i``), played as in training (tool calls included) and scored by the
    env's executor. Metrics: ``return`` (mean reward) and ``solved`` (share of tasks with reward
    1), the same per task kind (``code_return``, ``math_solved``, ...), the tool's use:
    ``tool_calls`` and ``tool_errors`` per episode, and ``called``, the share of episodes with a
    well-formed call (one that parsed, whatever it then did); and with ``eval_sampled`` the same
    of the sampled episodes (``sampled_solved``, ``sampled_tool_calls``, ...). The result adds the count of each error and ``tasks``,
    one row per task with its reward, error, tool calls and chat (and ``sampled``, the same of
    its sampled episode)."""
    tasks = options.eval_list()
    seeds = [-1 - i for i in range(len(tasks))]
    rows = _rows(tasks, play(seeds))
    metrics = dict(_solved(rows), **_tool_use(rows))
    if options.eval_sampled:
        sampled = _rows(tasks, play(seeds, greedy=False))
        metrics.update(sampled_solved=sum(row["reward"] == 1.0 for row in sampled) / len(sampled),
                       **{f"sampled_{k}": v for k, v in _tool_use(sampled).items()})
        for row, other in zip(rows, sampled, strict=True):
            row["sampled"] = other
    errors = dict(Counter(row["error"] for row in rows if row["error"] is not None))
    return metrics, dict(metrics, errors=errors, tasks=rows)


def _rows(tasks: list[Task], played: list) -> list[dict]:
    # The completion is the answer judged (the last turn); messages, the whole chat with tool calls.
    return [dict(id=task.id, kind=task.kind, reward=e.reward, error=e.error,
                 completion=e.turns[-1].text if e.turns else "", tool_calls=int(e.stats.get("tool_calls", 0)),
                 tool_errors=int(sum(v for k, v in e.stats.items() if k.startswith("tool_error_"))),
                 malformed_calls=int(e.stats.get("tool_error_malformed", 0)), messages=list(e.messages))
            for task, e in zip(tasks, played, strict=True)]


def _tool_use(rows: list[dict]) -> dict[str, float]:
    n = len(rows)
    return dict(tool_calls=sum(row["tool_calls"] for row in rows) / n,
                tool_errors=sum(row["tool_errors"] for row in rows) / n,
                called=sum(row["tool_calls"] > row["malformed_calls"] for row in rows) / n)


def _solved(rows: list[dict]) -> dict[str, float]:
    metrics = {}
    for kind in [None, *sorted({row["kind"] for row in rows})]:
        chosen = [row for row in rows if kind in (None, row["kind"])]
        prefix = f"{kind}_" if kind else ""
        metrics[f"{prefix}return"] = sum(row["reward"] for row in chosen) / len(chosen)
        metrics[f"{prefix}solved"] = sum(row["reward"] == 1.0 for row in chosen) / len(chosen)
    return metrics


def pictures(options: CodeOptions, run_dir: Path, rows: list[dict], final: dict) -> list[Path]:
    made = [learning_curve_png(rows, Path(run_dir) / "learning_curve.png", "coding and math tasks")]
    if options.tool:
        made.append(tool_use_png(rows, Path(run_dir) / "tool_use.png", "the python tool in the loop"))
    return made


def concurrency(options: CodeOptions) -> int:
    return options.concurrency


SPEC = EnvSpec(name="code", options=CodeOptions, factory=make_envs, corpus=corpus, probe_prompts=prompts,
               evaluate=evaluate, pictures=pictures, concurrency=concurrency)

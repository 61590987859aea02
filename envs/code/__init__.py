"""Coding and math environments whose rewards come from executing code."""

from __future__ import annotations

from typing import Callable


def code_env_factory(tasks: str = "", backend: str = "local", concurrency: int = 2, wall_s: float = 10.0,
                     cpu_s: float = 5.0, memory_mb: int = 512, output_kb: int = 64, disk_mb: int = 64,
                     isolation: str = "full") -> Callable:
    """A maker of CodeEnvs: local ones share one sandbox pool (``concurrency`` interpreters, which
    refuses to start without the ``isolation`` asked for); Together ones each get their own client,
    so each episode has its own session."""
    from envs.code.env import CodeEnv
    from envs.code.sandbox import Limits, LocalSandbox
    from envs.code.tasks import BUNDLED, load_tasks
    from envs.code.together_interpreter import TogetherCodeInterpreter

    task_list = load_tasks(tasks or BUNDLED)
    if backend == "local":
        limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, output_bytes=output_kb * 1024,
                        disk_mb=disk_mb)
        sandbox = LocalSandbox(size=concurrency, limits=limits, isolation=isolation)
        return lambda: CodeEnv(task_list, sandbox)
    if backend == "together":
        return lambda: CodeEnv(task_list, TogetherCodeInterpreter(timeout_s=wall_s + 30))
    raise ValueError(f"unknown code env backend {backend!r} (known: local, together)")

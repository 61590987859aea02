"""The ``python`` tool: the model runs code mid-episode and reads what it printed.

One interpreter session per episode, so a variable set in one call is there in the next:

- Together's Code Interpreter keeps a session's state on its side (``TogetherCodeInterpreter``).
- The local sandbox runs every execution in a fresh, isolated child (``sandbox.py``), which keeps
  nothing. :class:`ReplaySession` gives it a session by running the episode's earlier cells again,
  their output discarded, before the new one. The state is the same for code that is
  deterministic; a cell that draws random numbers or reads the clock gets new ones each time,
  and every execution pays for the cells before it (under the same limits).

What the tool shows the model is the program's output and the sandbox's verdict; the task's
tests never run here (the final answer is judged outside the sandbox, ``reward.py``).
"""

from __future__ import annotations

from envs.code.sandbox import ExecResult, Executor
from ray_forge.core.tools import function_schema

SCHEMA = function_schema("python", "Run Python code in a persistent session and see what it prints.",
                         {"code": {"type": "string", "description": "The code to run."}}, ["code"])

_REPLAY = '''
import io as _rf_io, sys as _rf_sys
_rf_out, _rf_err = _rf_sys.stdout, _rf_sys.stderr
_rf_sys.stdout = _rf_sys.stderr = _rf_io.StringIO()
for _rf_cell in {cells!r}:
    try:
        exec(compile(_rf_cell, "<earlier cell>", "exec"), globals())
    except BaseException:
        pass
_rf_sys.stdout, _rf_sys.stderr = _rf_out, _rf_err
del _rf_out, _rf_err, _rf_cell
'''


class ReplaySession(Executor):
    """A session on an executor that keeps no state: earlier cells run again before each new one."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.cells: list[str] = []

    def new_session(self) -> None:
        self.cells = []

    def execute(self, code: str) -> ExecResult:
        program = (_REPLAY.format(cells=self.cells) if self.cells else "") + code
        self.cells.append(code)
        return self.executor.execute(program)


def show(result: ExecResult) -> str:
    """An execution as the model reads it: what it printed, and why it was stopped if it was."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.error:
        parts.append(f"[stopped: {result.error}]")
    text = "\n".join(p.rstrip("\n") for p in parts if p)
    return text or "[no output]"


class PythonTool:
    """``python(code=...)`` on one episode's session."""

    name = "python"
    schema = SCHEMA

    def __init__(self, session: Executor) -> None:
        self.session = session

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise TypeError('the python tool takes {"code": <string>}')
        return show(self.session.execute(code))

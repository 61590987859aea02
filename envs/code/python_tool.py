"""The ``python`` tool: the model runs code mid-episode and reads what it printed.

One interpreter session per episode, so a variable set in one call is there in the next:

- Together's Code Interpreter keeps a session's state on its side (``TogetherCodeInterpreter``).
- The local sandbox runs every execution in a fresh, isolated child (``sandbox.py``), which keeps
  nothing. :class:`ReplaySession` gives it a session by running the episode's earlier cells again,
  their output discarded, before the new one. The state is the same for code that is
  deterministic; a cell that draws random numbers or reads the clock gets new ones each time,
  what an earlier cell bound to the output streams (a logging handler) writes nowhere, and every
  execution pays for the cells before it (under the same limits).

What the tool shows the model is the program's output and the sandbox's verdict; the task's
tests never run here (the final answer is judged outside the sandbox, ``reward.py``).
"""

from __future__ import annotations

from envs.code.sandbox import ExecResult, Executor
from ray_forge.core.tools import ToolError, function_schema

SCHEMA = function_schema("python", "Run Python code in a persistent session and see what it prints.",
                         {"code": {"type": "string", "description": "The code to run."}}, ["code"])

# Earlier cells run inside a function, so that a cell that clears or rebinds the module's names
# (``globals().clear()``) cannot break the replay; the new cell is compiled on its own, so its
# line numbers and ``from __future__`` imports are its own.
_REPLAY = '''
def _rf_replay(cells, namespace):
    import io, sys
    out, err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    try:
        for cell in cells:
            try:
                exec(compile(cell, "<earlier cell>", "exec"), namespace)
            except BaseException:
                pass
    finally:
        sys.stdout, sys.stderr = out, err
    return compile
_rf_compile = _rf_replay({cells!r}, globals())
globals().pop("_rf_replay", None)
exec(globals().pop("_rf_compile")({code!r}, "<cell>", "exec"), globals())
'''


class ReplaySession(Executor):
    """A session on an executor that keeps no state: earlier cells run again before each new one.
    A cell the sandbox stopped (a timeout, a limit) is not kept: it would stop every later call."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.cells: list[str] = []

    def new_session(self) -> None:
        self.cells = []

    def execute(self, code: str) -> ExecResult:
        result = self.executor.execute(_REPLAY.format(cells=self.cells, code=code))
        if result.error is None:
            self.cells.append(code)
        return result


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
        result = self.session.execute(code)
        if not result.ok:  # the model still reads all of it: a traceback is worth reading
            raise ToolError(show(result))
        return show(result)

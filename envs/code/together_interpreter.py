"""Together's Code Interpreter as an executor: one session per episode, reused across its steps.

Why the SDK's generic ``post``/``get`` and not a typed resource: together 3.x (current) dropped
the ``code_interpreter`` resource that 2.42 had, and pinning the 2.x line would hold every other
Together API back. The 3.x client still does what matters here: the key from
``TOGETHER_API_KEY``, the base URL from ``TOGETHER_BASE_URL`` (a host; paths carry ``/v1``),
retries with exponential backoff on 429 and 5xx (honouring ``retry-after``), and a timeout on
every request. The request and response JSON are those of ``POST /v1/tci/execute`` and
``GET /v1/tci/sessions``.

The key goes only into the client's Authorization header: it is never logged, never put in an
error message, and never part of the code sent for execution.
"""

from __future__ import annotations

import time
from typing import Any

from envs.code.sandbox import ExecResult, Executor


def _outputs_to_text(outputs: list[dict]) -> tuple[str, str, bool]:
    stdout, stderr, failed = [], [], False
    for item in outputs:
        kind, data = item.get("type"), item.get("data")
        if kind == "stdout":
            stdout.append(str(data))
        elif kind in ("stderr", "error"):
            stderr.append(str(data))
            failed = failed or kind == "error"
        elif isinstance(data, dict) and "text/plain" in data:  # display_data / execute_result
            stdout.append(str(data["text/plain"]) + "\n")
    return "".join(stdout), "".join(stderr), failed


def _expired(errors: Any) -> bool:
    return "session" in str(errors).lower()


class TogetherCodeInterpreter(Executor):
    """``execute(code) -> ExecResult``; call :meth:`new_session` at the start of every episode."""

    def __init__(self, timeout_s: float = 60.0, max_retries: int = 3, client=None) -> None:
        if client is None:
            from together import Together

            client = Together(timeout=timeout_s, max_retries=max_retries)  # key and base URL from the env
        self.client = client
        self.timeout_s = timeout_s
        self.session_id: str | None = None
        self._episode = 0
        """Bumped by ``new_session``: a call that returns after its episode ended (the tool gave up
        on it) must not hand its session to the next episode."""

    def new_session(self) -> None:
        """The next execution starts a fresh session (state from the last episode is dropped)."""
        self.session_id = None
        self._episode += 1

    def execute(self, code: str) -> ExecResult:
        start, episode, session = time.monotonic(), self._episode, self.session_id
        response, error = self._post(code, session)
        if error is None and response.get("errors") and session is not None and _expired(response["errors"]):
            # The service dropped the session: start a new one (its state is gone) and run again.
            session = None
            response, error = self._post(code, None)
        seconds = time.monotonic() - start
        if error is not None:
            return ExecResult("", "", None, error, seconds)
        if response.get("errors") or not response.get("data"):
            return ExecResult("", "", None, f"code interpreter error: {str(response.get('errors'))[:300]}", seconds)
        data = response["data"]
        if episode == self._episode:
            self.session_id = data.get("session_id", session)
        stdout, stderr, failed = _outputs_to_text(data.get("outputs") or [])
        return ExecResult(stdout, stderr, 1 if failed else 0, None, seconds)

    def _post(self, code: str, session_id: str | None) -> tuple[dict, str | None]:
        import together

        body: dict[str, Any] = {"code": code, "language": "python"}
        if session_id:
            body["session_id"] = session_id
        try:
            return self.client.post("/v1/tci/execute", body=body, cast_to=object), None
        except together.APITimeoutError:
            return {}, f"timeout: the code interpreter did not answer within {self.timeout_s:.0f}s"
        except together.APIStatusError as err:  # 429 and 5xx only after the SDK's own retries
            return {}, f"code interpreter answered HTTP {err.status_code}"
        except together.APIConnectionError as err:
            return {}, f"code interpreter unreachable ({err.__class__.__name__})"

    def sessions(self) -> list[dict]:
        response = self.client.get("/v1/tci/sessions", cast_to=object)
        return (response.get("data") or {}).get("sessions", [])

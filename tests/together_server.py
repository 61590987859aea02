"""A real HTTP server on loopback that speaks Together's Code Interpreter JSON, for tests.

It checks the bearer key, keeps one Python namespace per session, and can be told to fail:
answer the next requests with given HTTP statuses, expire a session, or answer slowly. It runs
test code in this process, which is fine for the tests' own snippets and nothing else.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    key: str
    fail_next: list[int] = field(default_factory=list)
    delay_s: float = 0.0
    expired: set[str] = field(default_factory=set)
    requests: list[dict] = field(default_factory=list)
    sessions: dict[str, dict] = field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    behaviour: Behaviour

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("retry-after-ms", "10")  # keep the SDK's backoff short in tests
        self.end_headers()
        self.wfile.write(body)

    def _guard(self, body: dict | None) -> bool:
        b = self.behaviour
        b.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if b.delay_s:
            time.sleep(b.delay_s)
        if self.headers.get("Authorization") != f"Bearer {b.key}":
            self._reply(401, {"error": {"message": "invalid api key"}})
            return False
        if b.fail_next:
            status = b.fail_next.pop(0)
            self._reply(status, {"error": {"message": f"injected {status}"}})
            return False
        return True

    def do_GET(self) -> None:
        if self.path != "/v1/tci/sessions":
            return self._reply(404, {"error": {"message": "not found"}})
        if self._guard(None):
            sessions = [{"id": sid} for sid in self.behaviour.sessions]
            self._reply(200, {"data": {"sessions": sessions}, "errors": None})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/tci/execute":
            return self._reply(404, {"error": {"message": "not found"}})
        if not self._guard(body):
            return
        sid = body.get("session_id")
        if sid in self.behaviour.expired or (sid and sid not in self.behaviour.sessions):
            return self._reply(200, {"data": None, "errors": [{"message": f"Session {sid} has expired"}]})
        sid = sid or f"ses_{uuid.uuid4().hex[:12]}"
        namespace = self.behaviour.sessions.setdefault(sid, {"__name__": "__main__"})
        out, outputs = io.StringIO(), []
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(body["code"], "<tci>", "exec"), namespace)
        except BaseException:
            outputs.append({"type": "error", "data": traceback.format_exc(limit=1)})
        if out.getvalue():
            outputs.insert(0, {"type": "stdout", "data": out.getvalue()})
        self._reply(200, {"data": {"outputs": outputs, "session_id": sid, "status": "success"}, "errors": None})


class TogetherServer:
    """``with TogetherServer(key) as server: os.environ["TOGETHER_BASE_URL"] = server.url``"""

    def __init__(self, key: str) -> None:
        self.behaviour = Behaviour(key=key)
        handler = type("Handler", (_Handler,), {"behaviour": self.behaviour})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "TogetherServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

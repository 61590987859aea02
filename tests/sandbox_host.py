"""A local sandbox served over stdin/stdout, so tests can run it as another user.

    python sandbox_host.py <folder holding envs/> '<Limits as JSON>'

Prints {"ready": true, "pids": [...]} (or {"ready": false, "error": ...}), then answers each
line {"code": ...} with the ExecResult as JSON. Standard library and envs/code only.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    from envs.code.sandbox import Limits, LocalSandbox, SandboxError

    try:
        box = LocalSandbox(size=1, limits=Limits(**json.loads(sys.argv[2])))
    except SandboxError as err:
        print(json.dumps({"ready": False, "error": str(err)}), flush=True)
        return
    print(json.dumps({"ready": True, "pids": box.pids}), flush=True)
    with box:
        for line in sys.stdin:
            print(json.dumps(asdict(box.execute(json.loads(line)["code"]))), flush=True)


if __name__ == "__main__":
    main()

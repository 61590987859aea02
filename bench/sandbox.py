"""Sandbox throughput: executions/s of trivial code through the local sandbox's warm pool, against
a bare ``subprocess.run([python, "-c", code])`` measured in the same run.

Every sandbox execution has full isolation (its namespaces, read-only root, private /tmp, no
capabilities, seccomp) and all its limits. The last line printed is a JSON object.

    python bench/sandbox.py [--n 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from envs.code.sandbox import LocalSandbox

CODE = "print(sum(range(100)))"


def rate(run, n: int) -> float:
    start = time.monotonic()
    for _ in range(n):
        run()
    return n / (time.monotonic() - start)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()

    def bare() -> None:
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
        assert out.stdout == "4950\n"

    with LocalSandbox(size=1, isolation="full") as box:
        def sandboxed() -> None:
            result = box.execute(CODE)
            assert result.ok and result.stdout == "4950\n", result

        bare(), sandboxed()  # warm both paths
        # Interleave halves so drift on this shared machine hits both alike.
        bare_rates = [rate(bare, args.n // 2) for _ in range(2)]
        box_rates = [rate(sandboxed, args.n // 2) for _ in range(2)]
        bare_rates.append(rate(bare, args.n // 2))
        box_rates.append(rate(sandboxed, args.n // 2))
        isolation = box.isolation
    bare_rate, box_rate = sorted(bare_rates)[1], sorted(box_rates)[1]
    result = {"bench": "sandbox", "executions": args.n, "bare_subprocess_per_s": round(bare_rate, 1),
              "sandbox_per_s": round(box_rate, 1), "speedup": round(box_rate / bare_rate, 2),
              "isolation": isolation, "root": os.geteuid() == 0, "target_5x": box_rate / bare_rate >= 5}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

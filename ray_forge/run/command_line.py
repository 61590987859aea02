"""What the jobs' command lines share: their arguments, one line per expected error, and the
command that resumes a run stopped by a fault."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

from ray_forge.config import ConfigError
from ray_forge.run.directory import Run


class RunStopped(RuntimeError):
    """A run stopped on an expected fault; the message ends with the command that resumes it."""


def parse_args(doc: str, default_config: str, argv: list[str] | None, example: str) -> argparse.Namespace:
    """``--config``, ``--resume`` and dotted overrides (``example``: two of them); logging set up."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config)
    parser.add_argument("--resume", metavar="RUN_DIR|auto",
                        help="continue a run from its newest checkpoint; auto: the latest unfinished run of "
                             "this config's run.name, or a fresh run if there is none")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args


@contextlib.contextmanager
def stops_resumably(run: Run, script: str, faults: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Turns one of ``faults`` (a dead trainer, a full disk) into a RunStopped that says how to go on."""
    try:
        yield
    except faults as err:
        raise RunStopped(f"{err}; resume with: python {script} --resume {run.run_dir}") from err


def run_cli(main: Callable[[], object], prog: str, expected: tuple[type[BaseException], ...]) -> None:
    """``main`` for a shell: an expected error is one line (what, why, how to go on), not a traceback."""
    try:
        main()
    except (RunStopped, ConfigError, *expected) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(1)

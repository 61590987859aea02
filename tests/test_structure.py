"""The shape the code keeps, read from the source: a driver that reads as the algorithm, small
functions, a fleet only the fleet changes, and facts stated in one place. Each rule has a planted
violation that it catches."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

GENERATED = {"envs/code/_syscalls_x86_64.py", "envs/code/_syscalls_aarch64.py"}
"""Syscall tables written by ``envs/code/_syscalls_generate.py``, not by hand."""
CHECKPOINT_FILES = {"MANIFEST", "DRIVER_STATE", "BUFFER_STATE", "TRAINER_DIR", "DCP_METADATA", "rank_file"}
CHECKPOINT_OWNERS = {"ray_forge/core/checkpoint.py", "ray_forge/actors/trainer.py", "ray_forge/actors/trainer_group.py",
                     "ray_forge/actors/buffer.py"}
"""The checkpoint manager and the components that write their own files into a checkpoint."""


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def long_functions(path: Path, limit: int = 60) -> list[str]:
    return [f"{node.name} (line {node.lineno}): {length(node)} lines"
            for node in functions(ast.parse(path.read_text())) if length(node) > limit]


@pytest.mark.parametrize("path", [p for p in sources("ray_forge", "jobs", "envs") if rel(p) not in GENERATED], ids=rel)
def test_no_function_is_longer_than_sixty_lines(path):
    assert not long_functions(path)


def test_the_driver_reads_as_the_algorithm():
    """``jobs/grpo.py`` is short, its ``train`` shorter, and it names no chaos, tracker or checkpoint file:
    those decide for themselves (step hooks, the metrics log, the checkpoint manager)."""
    path = ROOT / "jobs/grpo.py"
    tree = ast.parse(path.read_text())
    assert len(path.read_text().splitlines()) <= 180
    [train] = [f for f in functions(tree) if f.name == "train"]
    assert length(train) <= 40
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"ray_forge.run.chaos", "ray_forge.observe.trackers"}
    assert not checkpoint_file_names(path)


def fleet_assignments(path: Path) -> list[str]:
    """Assignments to an attribute of something named ``fleet`` (``fleet.x = ``, ``self.fleet.x += ``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and _names_fleet(sub.value):
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def _names_fleet(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "fleet") or (isinstance(node, ast.Attribute)
                                                                 and node.attr == "fleet")


def outside_fleet() -> list[Path]:
    return [p for p in sources("ray_forge", "jobs", "envs") if "fleet" not in p.relative_to(ROOT).parts
            and p.name != "fleet.py"]


def test_the_fleet_is_small_and_only_it_changes_its_state():
    fleet = ROOT / "ray_forge/run/fleet.py"
    assert not fleet.exists() or len(fleet.read_text().splitlines()) <= 200
    assert {rel(p): fleet_assignments(p) for p in outside_fleet() if fleet_assignments(p)} == {}


def remote_reads_of_nodes(path: Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "ray.nodes"]


def test_ray_nodes_is_read_in_one_module():
    readers = {rel(p) for p in sources("ray_forge", "jobs", "envs", "bench") if remote_reads_of_nodes(p)}
    assert readers == {"ray_forge/cluster/nodes.py"}


def literal_timeouts(path: Path) -> list[str]:
    """Calls given a ``timeout_s`` that holds a number written in place (``timeout_s=60``,
    ``limit_s + 60``): each bound has a name that says what it bounds."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for keyword in node.keywords if isinstance(node, ast.Call) else ():
            if keyword.arg == "timeout_s" and any(
                    isinstance(c, ast.Constant) and type(c.value) in (int, float) for c in ast.walk(keyword.value)):
                found.append(f"line {node.lineno}: {ast.unparse(node.func)}(timeout_s={ast.unparse(keyword.value)})")
    return found


@pytest.mark.parametrize("path", sources("ray_forge", "jobs", "envs"), ids=rel)
def test_no_timeout_is_a_number_written_at_the_call(path):
    assert not literal_timeouts(path)


def checkpoint_file_names(path: Path) -> list[str]:
    """Where a file of a checkpoint is named: its layout's constants, or the names themselves."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in CHECKPOINT_FILES:
            found.append(f"line {node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "ray_forge.core.checkpoint":
            found += [f"line {node.lineno}: {a.name}" for a in node.names if a.name in CHECKPOINT_FILES]
        elif isinstance(node, ast.Constant) and node.value in ("driver.pkl", "buffer.pkl", "manifest.json"):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("path", [p for p in sources("ray_forge", "jobs", "envs") if rel(p) not in CHECKPOINT_OWNERS],
                         ids=rel)
def test_only_the_checkpoint_manager_and_its_components_name_checkpoint_files(path):
    assert not checkpoint_file_names(path)


def test_the_rules_catch_planted_violations(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import ray\n"
        "from ray_forge.core.checkpoint import BUFFER_STATE\n"
        "def run(fleet, self):\n"
        "    fleet.carried = {}\n"
        "    self.fleet.restarts += 1\n"
        "    alive = ray.nodes()\n"
        "    call(ref, timeout_s=60, what='stats')\n"
        "    get(ref, timeout_s=limit_s + 30, what='play')\n"
        "    open(folder / 'driver.pkl')\n"
        + "".join(f"    x{i} = {i}\n" for i in range(60)))
    assert fleet_assignments(planted) == ["line 4: fleet.carried", "line 5: self.fleet.restarts"]
    assert remote_reads_of_nodes(planted) == [6]
    assert literal_timeouts(planted) == ["line 7: call(timeout_s=60)", "line 8: get(timeout_s=limit_s + 30)"]
    assert checkpoint_file_names(planted) == ["line 2: BUFFER_STATE", "line 9: 'driver.pkl'"]
    assert long_functions(planted) == ["run (line 3): 67 lines"]

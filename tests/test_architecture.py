"""The import rules of docs/architecture.md, read from the source (every import, at any depth)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS = {"config": 0, "core": 1, "models": 2, "observe": 2, "remote": 2, "net": 2, "weights": 3, "cluster": 3,
          "actors": 4, "run": 5}
"""A part of ray_forge may import its own layer and those below it, never one above."""
ENV_MAY_IMPORT = ("ray_forge.core", "ray_forge.config", "ray_forge.observe.plots")
"""What an env may use of the library: the env protocol and spec, config loading, plots. None of
them imports Ray (checked below), so an env cannot reach Ray through them."""
NO_RAY = ("ray", "vllm", "torchtitan", "torchstore")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones made absolute."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            # ``from ray_forge import actors`` imports ray_forge.actors: count each name as a module too.
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    return module.split(".")[1]


def test_every_part_of_the_library_has_a_layer():
    parts = {p.relative_to(ROOT / "ray_forge").parts[0].removesuffix(".py") for p in sources("ray_forge")}
    assert parts - {"__init__"} == set(LAYERS)


def library_violations(path: Path) -> list[str]:
    own = layer("ray_forge." + ".".join(path.relative_to(ROOT / "ray_forge").with_suffix("").parts))
    wrong = []
    for line, module in imports(path):
        if under(module, "envs", "jobs", "bench", "tests", "cluster"):
            wrong.append(f"line {line}: {module} (the library never imports envs/ or jobs/)")
        elif under(module, "ray_forge") and module != "ray_forge" and LAYERS[layer(module)] > LAYERS[own]:
            wrong.append(f"line {line}: {module} (layer {layer(module)} is above {own})")
        elif (own in ("config", "core") or path.name == "plots.py") and under(module, *NO_RAY):
            wrong.append(f"line {line}: {module} ({own} imports no Ray, vLLM or TorchTitan)")
    return wrong


def env_violations(path: Path) -> list[str]:
    return [f"line {line}: {module}" for line, module in imports(path)
            if under(module, *NO_RAY, "torch", "jobs")
            or (under(module, "ray_forge") and not under(module, *ENV_MAY_IMPORT))]


@pytest.mark.parametrize("path", sources("ray_forge"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_downwards_only_and_never_envs_or_jobs(path):
    assert not library_violations(path)


@pytest.mark.parametrize("path", sources("envs"), ids=lambda p: str(p.relative_to(ROOT)))
def test_envs_import_no_ray_torch_vllm_or_the_librarys_actors(path):
    assert not env_violations(path)


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The checks above read real imports: ones planted in a copy of the tree are all found."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "ray_forge" / "core").mkdir(parents=True)
    (tmp_path / "envs").mkdir()
    planted = tmp_path / "ray_forge" / "core" / "x.py"
    planted.write_text("def f():\n    from envs.blackjack import SPEC\n    import ray\n"
                       "    from ..actors import launch\n    from ray_forge import run\n")
    assert [v.split(" (")[0] for v in library_violations(planted)] == [
        "line 2: envs.blackjack", "line 2: envs.blackjack.SPEC", "line 3: ray", "line 4: ray_forge.actors",
        "line 4: ray_forge.actors.launch", "line 5: ray_forge.run"]
    env = tmp_path / "envs" / "y.py"
    env.write_text("import torch\nfrom ray_forge.actors.policy import VLLMPolicy\n"
                   "from ray_forge.core.env import EnvSpec\nfrom ray_forge.observe import metrics\n")
    assert env_violations(env) == ["line 1: torch", "line 2: ray_forge.actors.policy",
                                   "line 2: ray_forge.actors.policy.VLLMPolicy", "line 4: ray_forge.observe",
                                   "line 4: ray_forge.observe.metrics"]

"""The import rules of docs/architecture.md, read from the source (every import, at any depth)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS = {"identity": 0, "config": 0, "core": 1, "models": 2, "observe": 2, "remote": 2, "net": 2, "weights": 3, "cluster": 3,
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


# -- no circles inside a package -----------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports (at any depth, ``TYPE_CHECKING`` and
    function-level imports included). ``from pkg import name`` is an edge to the package's
    ``__init__``; ``pkg.mod.name`` to ``pkg.mod``."""
    modules = {module_name(p): p for p in paths}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {target for _, imported in imports(path) if (target := resolve(imported)) and target != name
                       and (target == package or target.rpartition(".")[0] == package)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("folder", ["ray_forge", "envs"])
def test_no_package_imports_itself_in_a_circle(folder):
    assert circles(package_graph(sources(folder))) == []


def test_the_circle_check_finds_a_planted_circle(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    package = tmp_path / "ray_forge" / "weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from ray_forge.weights.store import WeightStore\n")
    (package / "store.py").write_text("from ray_forge.weights.controller import Client\n")
    (package / "controller.py").write_text("def f():\n    import ray_forge.weights.collective\n")
    (package / "collective.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ray_forge.weights.store import WeightStore\n")
    (package / "base.py").write_text("import ray_forge.weights.layout\n")
    (package / "layout.py").write_text("x = 1\n")
    found = circles(package_graph(sources("ray_forge")))
    assert found == [["ray_forge.weights.collective", "ray_forge.weights.controller", "ray_forge.weights.store"]]


# -- one protocol for every weight transport -----------------------------------------------------
TRANSPORT_NAMES = ("shm", "object_store", "nixl", "collective", "torchstore")
TRANSPORT_MODULES = ("ray_forge.weights.shm", "ray_forge.weights.object_store", "ray_forge.weights.nixl",
                     "ray_forge.weights.collective", "ray_forge.weights.torchstore_transport",
                     "ray_forge.weights.rendezvous", "ray_forge.weights.stored")


def transport_mentions(path: Path, names_allowed: bool = False) -> list[str]:
    """Where a module outside ``weights/`` names a transport (a string constant), asks whether it
    pushes, or imports a transport's own module. ``names_allowed``: the config schema, which
    lists the names as the user's choices and checks them when the config loads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in TRANSPORT_NAMES and not names_allowed:
            found.append(f"line {node.lineno}: the transport name {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "pushes":
            found.append(f"line {node.lineno}: asks whether a transport pushes")
    found += [f"line {line}: imports {module}" for line, module in imports(path) if under(module, *TRANSPORT_MODULES)]
    return found


def outside_weights() -> list[Path]:
    return [p for p in sources("ray_forge") + sources("jobs") if "weights" not in p.relative_to(ROOT).parts]


@pytest.mark.parametrize("path", outside_weights(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_weight_store_knows_how_weights_travel(path):
    """The driver, the fleet and the actors ask ``weights/`` to sync a version and never ask how:
    no transport names, no push-or-pull branches, no transport's module outside ``weights/``
    (the config schema lists the names as the user's choices)."""
    in_schema = path == ROOT / "ray_forge" / "config" / "schema.py"
    assert transport_mentions(path, names_allowed=in_schema) == []


def test_the_transport_check_finds_what_it_forbids(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    planted = tmp_path / "jobs" / "x.py"
    planted.parent.mkdir()
    planted.write_text("from ray_forge.weights.collective import open_push\n"
                       "def f(spec):\n    if spec.pushes or spec.transport == 'nixl':\n        return 1\n")
    imported = ["line 1: imports ray_forge.weights.collective", "line 1: imports ray_forge.weights.collective.open_push"]
    assert transport_mentions(planted) == [
        "line 3: asks whether a transport pushes", "line 3: the transport name 'nixl'", *imported]
    assert transport_mentions(planted, names_allowed=True) == ["line 3: asks whether a transport pushes", *imported]


# -- actors are named by their identity ----------------------------------------------------------
ROLE_NAME = re.compile(r"\b(policy|env|trainer)-(\d|%d|\{)")
"""A fleet member's name written out (``policy-0``), or a format that builds one."""


def joins_a_role(node: ast.JoinedStr) -> bool:
    """``f"{role}-{i}"``: a value called role, then a dash."""
    pairs = zip(node.values, node.values[1:])
    return any(isinstance(v, ast.FormattedValue) and isinstance(c, ast.Constant) and str(c.value).startswith("-")
               and "role" in ast.unparse(v.value).split(".")[-1] for v, c in pairs)


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may say ``policy-0``)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            found |= {id(stmt.value) for stmt in body
                      if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)}
    return found


def actor_name_handling(path: Path) -> list[str]:
    """Where a module builds an actor's name from its role and index, writes one out, or takes a
    name apart; only ``ray_forge/core/identity.py`` may (the first two)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{" for v in node.values)
            if ROLE_NAME.search(text) or joins_a_role(node):
                found.append(f"line {node.lineno}: builds an actor's name ({text!r})")
            skip |= {id(v) for v in node.values}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and ROLE_NAME.search(node.value):
            found.append(f"line {node.lineno}: writes an actor's name ({node.value!r})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("split", "rsplit", "partition", "rpartition")
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "-"):
            found.append(f"line {node.lineno}: takes a name apart at '-'")
    return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]))


@pytest.mark.parametrize("path", [p for p in sources("ray_forge") + sources("jobs") if p.name != "identity.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_actor_name_is_built_or_parsed_outside_the_identity_type(path):
    assert actor_name_handling(path) == []


def test_the_name_check_finds_planted_names(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text('"""Docs may say policy-0."""\n'
                       'def f(i, name):\n    """Or env-3."""\n    a = f"trainer-{i}"\n    b = "policy-1"\n'
                       '    role = name.split("-")[0]\n    log("env-%d died", i)\n    return f"env-{i}.step"\n'
                       'names = {f"{role}-{i}" for role in ("env", "policy") for i in range(2)}\n')
    assert [v.split(":")[0] for v in actor_name_handling(planted)] == [
        "line 4", "line 5", "line 6", "line 7", "line 8", "line 9"]

"""Dependencies point one way: no import cycles in ``env_service/`` and ``seal/``, and the environment
service never imports the trainer.

Reads every module's imports with ``ast`` — module-level and inside functions alike, since an import
moved into a function hides a wrong-direction dependency without removing it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("env_service", "seal")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` (``pkg.mod`` or ``pkg.mod.attr``) names, or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``module`` imports anywhere in its source (importing a package itself excluded)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the containing package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module and target not in PACKAGES:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imported(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A concrete cycle inside one strongly connected component, for the failure message."""
    start = min(component)
    path, seen, node = [start], {start}, start
    while True:
        node = min(n for n in graph[node] if n in component)
        if node in seen:
            return path[path.index(node) :] + [node]
        path.append(node)
        seen.add(node)


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "env_service.bfcl.episode" in graph["env_service.bfcl.ood_episode"]
    assert "env_service.bfcl.ood_episode" in graph["env_service.episodes.manager"]
    assert "seal.prompt_budget" in graph["seal.launch.preflight"]  # imported inside a function there
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_environment_service_never_imports_the_trainer():
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.startswith("env_service")
        for target in targets
        if target.startswith("seal")
    )
    assert not wrong, wrong


def test_the_environment_table_in_the_architecture_doc_is_in_dependency_order():
    """docs/architecture.md lists env_service's modules so that each imports only modules above it."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Environment side") : doc.index("## Trainer side")]
    listed = [f"env_service.{name.replace('/', '.')}" for name in re.findall(r"^\| `([\w/]+)\.py`", section, re.M)]
    graph = import_graph()
    modules = sorted(m for m, path in _modules().items() if m.startswith("env_service.") and path.name != "__init__.py")
    assert sorted(listed) == modules, "modules missing from or unknown to the table"
    position = {module: i for i, module in enumerate(listed)}
    upward = [f"{m} -> {t}" for m in listed for t in sorted(graph[m]) if position.get(t, -1) > position[m]]
    assert not upward, upward


#: env_service's layers, bottom to top (the folder names; "" is a module directly in env_service/).
ENV_LAYERS = {"base": 0, "bfcl": 1, "workers": 2, "episodes": 3, "http": 4, "top": 5}
ENV_BASE = {"vocabulary", "errors", "files", "json_safe", "sizes", "abandon", "control_text", "config_blocks"}


def env_layer(module: str) -> int:
    part = module.split(".")[1] if module.count(".") else ""
    if part in ENV_LAYERS:
        return ENV_LAYERS[part]
    return ENV_LAYERS["base"] if part in ENV_BASE else ENV_LAYERS["top"]


def test_environment_layers_import_only_downward():
    """http -> episodes -> workers -> bfcl -> the shared words: a layer never imports one above it."""
    graph = import_graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith("env_service.")
        for target in targets
        if target.startswith("env_service.") and env_layer(target) > env_layer(module)
    )
    assert not upward, upward
    assert env_layer("env_service.http.service") > env_layer("env_service.episodes.manager")  # the order is real


#: seal/'s floors, bottom to top; a module's floor is that of the longest prefix naming it. Each floor imports only
#: its own and the ones below: what several layers share lives below them, and the commands (the launcher, reporting,
#: ``python -m seal.eval`` and its checkpoint runner, which runs the launcher in validation-only mode) sit on top.
SEAL_FLOORS = (
    (
        "foundation",
        (
            "seal.units",
            "seal.paper_numbers",
            "seal.resume",
            "seal.env_clients",
            "seal.capability_state",
            "seal.validation",
            "seal.cpu",
        ),
    ),
    (
        "mechanisms and results",
        (
            "seal.advantage",
            "seal.apatch",
            "seal.diagnostics",
            "seal.failed_episodes",
            "seal.prompt_budget",
            "seal.config",
            "seal.results",
        ),
    ),
    ("the step and evaluation's runners", ("seal.agent_loop", "seal.trainer", "seal.verl_plugins", "seal.eval")),
    ("the launcher", ("seal.launch",)),
    ("commands", ("seal.eval.__main__", "seal.eval.checkpoint", "seal.report")),
)


def seal_floor(module: str) -> int | None:
    """The floor of a module under seal/ (its index in ``SEAL_FLOORS``), None when no prefix names it."""
    matches = [
        (len(prefix), floor)
        for floor, (_, prefixes) in enumerate(SEAL_FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def test_every_seal_module_has_a_floor():
    unplaced = sorted(m for m in _modules() if m.startswith("seal.") and seal_floor(m) is None)
    assert not unplaced, f"give these a floor in SEAL_FLOORS: {unplaced}"


def test_seal_floors_import_only_downward():
    """The step never imports the launcher or the commands, the results format never imports the step, the launcher
    never imports reporting; an import up a floor fails here, with where it points."""
    upward = sorted(
        f"{module} ({SEAL_FLOORS[seal_floor(module)][0]}) -> {target} ({SEAL_FLOORS[seal_floor(target)][0]})"
        for module, targets in import_graph().items()
        if module.startswith("seal.")
        for target in targets
        if target.startswith("seal.") and seal_floor(target) > seal_floor(module)
    )
    assert not upward, upward
    assert seal_floor("seal.eval.checkpoint") > seal_floor("seal.launch") > seal_floor("seal.trainer")  # the order
    assert seal_floor("seal.trainer") > seal_floor("seal.results.records") >= seal_floor("seal.apatch")


def test_tests_sit_in_their_behaviours_folders_and_share_only_the_support_package():
    """Every test file is in the folder of what it checks (docs/architecture.md, "Tests"), and what tests share is in
    ``tests/support``: a test module imported by another would make one test's file the other's library."""
    tests = ROOT / "tests"
    loose = sorted(path.name for path in tests.glob("test_*.py"))
    assert not loose, f"put these in the folder of the behaviour they check: {loose}"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("support", "__pycache__"))
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert folders == sorted(re.findall(r"^\| `(\w+)/` \|", section, re.M))
    borrowed = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            borrowed += [f"{path.relative_to(ROOT)} -> {n}" for n in names if n.rpartition(".")[2].startswith("test_")]
    assert not borrowed, borrowed

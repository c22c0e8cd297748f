"""Dependencies point one way: no import cycles in ``env_service/`` and ``seal/``, and the environment
service never imports the trainer.

Reads every module's imports with ``ast`` — module-level and inside functions alike, since an import
moved into a function hides a wrong-direction dependency without removing it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    assert "env_service.episode" in graph["env_service.ood_episode"]
    assert "env_service.ood_episode" in graph["env_service.manager"]
    assert "env_service.client" in graph["seal.launch"]  # imported inside a function there
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
    listed = [f"env_service.{name}" for name in re.findall(r"^\| `(\w+)\.py`", section, re.M)]
    graph = import_graph()
    modules = sorted(m for m in graph if m.startswith("env_service."))
    assert sorted(listed) == modules, "modules missing from or unknown to the table"
    position = {module: i for i, module in enumerate(listed)}
    upward = [f"{m} -> {t}" for m in listed for t in sorted(graph[m]) if position.get(t, -1) > position[m]]
    assert not upward, upward

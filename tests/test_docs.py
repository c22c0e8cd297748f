"""The README and docs/ say only what holds: every relative link reaches a file (and the heading it names), and
every command of a ```bash block that can run offline is checked without running it: a launcher recipe composes
with its overrides, a module, script or test file exists, each ``--flag`` is one its parser accepts, and an
install target is one ``scripts/install.sh`` handles. Commands that cannot be checked so (they need a GPU, or set
up the user's shell) are listed in ``SKIPPED`` with the reason; any other command fails until it gets a check."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from seal.launch import compose_recipe

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands that cannot be checked here, by how they start, with why.
SKIPPED = {
    "python3.12 -m venv": "makes the GPU venv: needs Python 3.12 and writes .venv",
    ". .venv/bin/activate": "activates that venv in the user's shell",
    "vllm serve": "serves a trained checkpoint: needs a GPU, vLLM and the checkpoint",
}
# Commands whose script another change is adding; checked once the file exists.
PENDING_SCRIPTS = {"scripts/reproduce.py": "written in a parallel change (issue 16)"}

FENCE = re.compile(r"^[ \t]*```(\w*)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|"}


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text outside fenced blocks (a ``#`` there is a comment, not a heading; a link there is code)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    headings = re.findall(r"^#{1,6}\s+(.+)$", prose(path.read_text()), re.M)
    return frozenset(slug(h) for h in headings)


def relative_links(path: Path) -> list[str]:
    targets = LINK.findall(prose(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_reaches_its_file_and_heading(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        file = (doc.parent / file_part).resolve() if file_part else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, broken


# ---- commands ----------------------------------------------------------------------------------------------


def bash_lines(text: str) -> list[str]:
    """Each command line of the ```bash blocks, continuation lines joined."""
    lines = []
    for language, body in FENCE.findall(text):
        if language == "bash":
            lines += [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def commands(line: str) -> list[list[str]]:
    """The simple commands of a line: comments dropped, split at ``&&``/``;``/``|``, leading ``VAR=value`` and the
    brackets of optional arguments (``[--port 8082]``) removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    result, current = [], []
    for token in [*lexer, ";"]:
        if token in SEPARATORS:
            while current and ENV_ASSIGNMENT.match(current[0]):
                current.pop(0)
            if current:
                result.append(current)
            current = []
        else:
            current.append(token.strip("[]"))
    return result


def documented_commands() -> list[tuple[str, list[str]]]:
    return [
        (f"{doc_id(doc)}: {line}", argv)
        for doc in DOCS
        for line in bash_lines(doc.read_text())
        for argv in commands(line)
    ]


@functools.cache
def accepted_flags(*entry: str) -> frozenset[str]:
    """The options an entry point's parser lists under its help (one ``--help`` run per entry point)."""
    out = subprocess.run([sys.executable, *entry, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(entry)} --help failed:\n{out.stderr[-2000:]}"
    options = out.stdout.partition("\noptions:\n")[2]
    flags = set()
    for line in options.splitlines():
        listed = re.match(r"^\s{2,}(-\S.*?)(?:\s{2,}|$)", line)
        if listed:
            flags |= set(re.findall(r"--[\w-]+", listed.group(1)))
    return frozenset(flags)


def flags_of(argv: list[str]) -> list[str]:
    return [arg.partition("=")[0] for arg in argv if arg.startswith("--")]


def unknown_flags(entry: tuple[str, ...], argv: list[str]) -> list[str]:
    return [flag for flag in flags_of(argv) if flag not in accepted_flags(*entry)]


@functools.cache
def install_targets() -> frozenset[str]:
    script = (ROOT / "scripts" / "install.sh").read_text()
    default = re.search(r'target="\$\{1:-(\w[\w-]*)\}"', script).group(1)
    return frozenset({default, *re.findall(r'"\$target" = "([\w-]+)"', script)})


def check_launcher(entry: tuple[str, ...], args: list[str]) -> list[str]:
    problems = unknown_flags(entry, args)
    if "--conf" not in args:
        return [*problems, "no --conf"]
    at = args.index("--conf")
    conf, rest = args[at + 1], args[:at] + args[at + 2 :]
    overrides = [a for a in rest if not a.startswith("--")]
    try:
        compose_recipe(str(ROOT / conf), overrides)
    except Exception as error:  # a missing recipe, an unknown key, a bad override: each makes the doc wrong
        problems.append(f"{conf} {overrides} does not compose: {error}")
    return problems


def check_module(module: str, args: list[str]) -> list[str]:
    if module == "pytest":
        return [f"no test file {a}" for a in args if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
    if module in ("seal.eval", "env_service"):
        subcommand = next(a for a in args if not a.startswith("-"))
        return unknown_flags(("-m", module, subcommand), args)
    return [f"no check for python -m {module}: add one, or a SKIPPED entry with the reason"]


def check_python(argv: list[str]) -> list[str]:
    if argv[1] == "-m":
        return check_module(argv[2], argv[3:])
    script, args = argv[1], argv[2:]
    if script in PENDING_SCRIPTS and not (ROOT / script).exists():
        pytest.skip(f"{script}: {PENDING_SCRIPTS[script]}")
    if not (ROOT / script).is_file():
        return [f"no script {script}"]
    if script == "launcher.py":
        return check_launcher((script,), args)
    return unknown_flags((script,), args)


def check(argv: list[str]) -> list[str]:
    text = " ".join(argv)
    for prefix, reason in SKIPPED.items():
        if text.startswith(prefix):
            pytest.skip(reason)
    program = argv[0]
    if program in ("python", "python3") or program.endswith("/bin/python"):
        return check_python(argv)
    if argv[:2] == ["bash", "scripts/install.sh"]:
        target = argv[2] if len(argv) > 2 else "cpu"
        return [] if target in install_targets() else [f"install.sh has no target {target!r}"]
    return [f"no check for {program!r}: add one, or a SKIPPED entry with the reason"]


@pytest.mark.parametrize(("where", "argv"), documented_commands(), ids=[w for w, _ in documented_commands()])
def test_every_documented_command_names_what_exists(where, argv):
    problems = check(argv)
    assert not problems, problems


def test_the_docs_have_commands_of_every_kind_checked():
    """A change to the fence or line parsing that found nothing would pass every check above vacuously."""
    kinds = {" ".join(argv[:3]) for _, argv in documented_commands()}
    expected = {
        "python launcher.py --conf",
        "python -m seal.eval",
        "python -m env_service",
        "bash scripts/install.sh gpu",
    }
    assert expected <= kinds, sorted(kinds)

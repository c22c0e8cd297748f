"""The README and docs/ say only what holds: every relative link reaches a file (and the heading it names), and
every command of a ```bash block that can run offline is checked without running it: a launcher recipe composes
with its overrides, a module, script or test file exists, each ``--flag`` is one its parser accepts, and an
install target is one ``scripts/install.sh`` handles. Commands that cannot be checked so (they need a GPU, or set
up the user's shell) are listed in ``SKIPPED`` with the reason; any other command fails until it gets a check.

Every output path a doc names is where the code writes it: a recipe's run or checkpoint folder as the recipe
resolves it, the reproduction plan's layout as the plan writes it, and what lies inside a run's folders as CI's own
CPU run wrote it (``.ci/run`` runs ``exp/cpu_tiny.yaml`` before the tests; no second run here). Every size the docs
state is the estimate that computes it (``memory_estimate``, the plan's disk and time), and
``docs/recipes.md``'s key reference is the one ``python -m seal.config docs`` generates."""

from __future__ import annotations

import functools
import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from seal.launch.recipe import compose_recipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands that cannot be checked here, by how they start, with why.
SKIPPED = {
    "python3.12 -m venv": "makes the GPU venv: needs Python 3.12 and writes .venv",
    ". .venv/bin/activate": "activates that venv in the user's shell",
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


# ---- output paths ------------------------------------------------------------------------------------------

OUTPUT = re.compile(r"(?<![\w/.<$-])((?:checkpoints|experiments|eval_results|outputs|runs|tables)/[^\s`'\"),;:\]]*)")
#: Paths the docs name that are no output of ours, with why.
NOT_OUTPUTS = {"checkpoints/best": "evaluation.md's example of a two-part path seal.eval takes for a path"}
#: Folders of CI's own CPU run (``.ci/run``: ``python launcher.py --conf exp/cpu_tiny.yaml`` before the tests).
CI_RUN = {"run": ROOT / "experiments" / "cpu_tiny", "checkpoints": ROOT / "checkpoints" / "SEAL" / "cpu_tiny"}
ROW = "qwen2.5-7b__seal"  # a row of the plan, for its <row> placeholders


def ci_run() -> dict[str, Path]:
    """CI's run folders; a test that needs them skips where that run was not made (it fails under CI)."""
    if not all(path.is_dir() for path in CI_RUN.values()):
        if os.environ.get("CI") == "true":
            pytest.fail("CI's cpu_tiny run (.ci/run, before the tests) left no experiments/cpu_tiny or checkpoints")
        pytest.skip("no cpu_tiny run here (`python launcher.py --conf exp/cpu_tiny.yaml` makes one; CI runs it first)")
    return CI_RUN


def hand_written(doc: Path) -> str:
    """A doc's text without its generated part (recipes.md's key reference shows defaults, not outputs)."""
    from seal.config import reference

    text = doc.read_text()
    if reference.BEGIN in text:
        text = text[: text.index(reference.BEGIN)] + text[text.index(reference.END) :]
    return text


def output_paths() -> list[tuple[str, str]]:
    return sorted(
        {(doc_id(doc), path.rstrip("/.")) for doc in DOCS for path in OUTPUT.findall(hand_written(doc)) if path}
    )


@functools.cache
def recipe_named(experiment: str):
    """The recipe whose trainer.experiment_name is ``experiment``, composed (None: no recipe has it)."""
    for recipe in sorted((ROOT / "exp").glob("*.yaml")):
        if re.search(rf"^\s*experiment_name:\s*{re.escape(experiment)}\s*$", recipe.read_text(), re.M):
            return compose_recipe(str(recipe))
    return None


@functools.cache
def the_plan() -> tuple:
    from seal.report import reproduction

    return tuple(reproduction.plan("OUT"))


@functools.cache
def plan_outputs() -> frozenset[str]:
    """Every path the reproduction plan's commands write or read under ``OUT``."""
    tokens = {t.partition("=")[2] or t for step in the_plan() for t in step.argv}
    return frozenset(t.removeprefix("OUT/") for t in tokens if t.startswith("OUT/"))


def inside_ci_run(rest: str, where: str) -> list[str]:
    """``rest`` (a path inside a run's folder, ``*`` allowed) exists in CI's run folder ``where``."""
    folder = ci_run()[where]
    return [] if rest in ("", ".") or glob.glob(str(folder / rest)) else [f"CI's run wrote no {folder.name}/{rest}"]


def output_problems(path: str) -> list[str]:
    """Where the code writes ``path``, or why it does not."""
    import make_tables

    from seal.eval.__main__ import build_parser, out_dir_of

    parts = path.split("/")
    root, name, rest = parts[0], parts[1] if len(parts) > 1 else "", "/".join(parts[2:])
    if path in NOT_OUTPUTS:
        return []
    if "<row>" in path:  # the reproduction plan's layout, under --out
        concrete = path.replace("<row>", ROW)
        return [] if any(t == concrete or t.startswith(concrete + "/") for t in plan_outputs()) else [path]
    if root == "checkpoints":
        recipe = recipe_named(parts[2]) if len(parts) > 2 else None
        if recipe is None or str(recipe.trainer.default_local_dir) != "/".join(parts[:3]):
            return [f"{path}: no recipe writes its checkpoints to {'/'.join(parts[:3])}"]
        return inside_ci_run("/".join(parts[3:]), "checkpoints")
    if root == "experiments":
        if name in ("", "<experiment_name>"):  # the folder of every run, seal.run_dir's default
            defaults = (ROOT / "seal" / "config" / "seal_defaults.yaml").read_text()
            return [] if "run_dir: experiments/${trainer.experiment_name}" in defaults else [path]
        recipe = recipe_named(name)
        if recipe is not None:
            ok = str(recipe.seal.run_dir) == f"experiments/{name}"
            return inside_ci_run(rest, "run") if ok else [f"{path}: the recipe's run folder is {recipe.seal.run_dir}"]
        scripts = [
            (ROOT / "scripts" / s).read_text()
            for s in ("reproduce.py", "learning_check.py", "apatch_exact_gpu.py", "gpu_check.py")
        ]
        if not rest and any(f"experiments/{name}" in text for text in scripts):
            return []  # a script's --out, as the script's own usage names it
        if not rest and name.endswith(make_tables.OOD_SUFFIX) and make_tables.table1_key(name[: -len("__ood")]):
            return []  # an evaluation folder named for the table row make_tables puts it in
        return [f"{path}: no recipe, script default or table row writes there"]
    if root == "eval_results":
        args = build_parser().parse_args(["endpoint", "--endpoint", "http://x/v1", "--model", "NAME"])
        return [] if out_dir_of(args) == "eval_results/NAME" and name == "<model>" else [path]
    if root == "tables":  # make_tables.py's --out
        return [] if name in ("", *make_tables.TABLE_FILES) else [path]
    if root == "outputs":  # the CPU runs' tiny models
        return [] if name == "" and any(d.startswith("outputs/") for d in tiny_model_dirs()) else [path]
    return [f"no check for {path}: add one"]


def tiny_model_dirs() -> list[str]:
    from seal.report.reproduction import swap_values

    return [swap_values()["seal.tiny_model.out_dir"]]


@pytest.mark.parametrize(("where", "path"), output_paths(), ids=[f"{w}: {p}" for w, p in output_paths()])
def test_every_output_path_a_doc_names_is_where_the_code_writes_it(where, path):
    sys.path.insert(0, str(ROOT / "scripts"))
    assert output_problems(path) == []


def test_what_a_run_writes_is_what_cis_run_wrote():
    """architecture.md's list of a run's files and folders, each found in CI's cpu_tiny run (its run folder or its
    checkpoint folder): a renamed figure or dump makes the doc wrong."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## What a run writes", 1)[1]
    named = [t for t in re.findall(r"`([^`]+)`", text) if re.search(r"(\.(jsonl|json|txt|png)|/)$", t) or t == "best"]
    named = [t for t in named if not t.startswith(("experiments/", "val-core", "seal/"))]
    assert len(named) >= 12, named
    runs = ci_run()
    missing = [
        t for t in named if not any(glob.glob(str(runs[w] / re.sub(r"<\w+>", "*", t).rstrip("/"))) for w in runs)
    ]
    assert missing == []


def test_the_best_checkpoints_export_is_the_size_the_estimate_says():
    """bf16, as verl's model merger writes it (fp32 would be twice the estimate)."""
    from seal.launch.memory_estimate import checkpoint_disk

    export = ci_run()["checkpoints"] / "best" / "huggingface" / "model.safetensors"
    estimated = checkpoint_disk(compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"))).export_bytes
    assert abs(export.stat().st_size - estimated) / estimated < 0.01, (export.stat().st_size, estimated)


# ---- sizes and times ---------------------------------------------------------------------------------------

#: Sizes the docs state that no estimate computes, with why.
NOT_ESTIMATED = {
    "80 GB": "the memory of the GPUs the recipes ask for",
    "80GB": "the same, in a GPU's name",
    "~200 GB": "host memory of the released recipe's node",
    "4 GB": "a rehearsal row's memory, measured (reproduce.md)",
}
SIZE = re.compile(r"[~≈]?\d[\d,.]*\s?(?:GiB|GB|MiB)\b")
ESTIMATED_DOCS = ("gpu.md", "reproduce.md", "recipes.md")


@functools.cache
def disk_of(recipe: str, save_freq: int):
    """``checkpoint_disk`` of a recipe with ``trainer.save_freq`` set (one composition per recipe, the plan's)."""
    import copy

    from seal.launch.memory_estimate import checkpoint_disk
    from seal.report import reproduction

    config = copy.deepcopy(reproduction.composed(recipe))
    config.trainer.save_freq = save_freq
    return checkpoint_disk(config)


def disk_table() -> list[list[str]]:
    text = (ROOT / "docs" / "gpu.md").read_text()
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| `exp/")]


@functools.cache
def estimated_sizes() -> dict[str, str]:
    """{size as a doc states it: what computes it}: each recipe's checkpoint disk, the plan's disk."""
    from seal.report import reproduction
    from seal.units import disk_size

    sizes = {}
    for recipe_cell, *_ in disk_table():
        recipe = recipe_cell.split("`")[1]
        periodic = re.search(r"save_freq: (\d+)", " ".join(_)) or None
        for save_freq in (0, int(periodic.group(1)) if periodic else 10):
            disk = disk_of(recipe, save_freq)
            for n_bytes in (disk.checkpoint_bytes, disk.export_bytes, disk.total_bytes):
                sizes[disk_size(n_bytes)] = f"checkpoint_disk({recipe}, save_freq={save_freq})"
            sizes[f"{disk.checkpoint_bytes / 1e9:.0f} GB"] = f"checkpoint_disk({recipe}): one checkpoint, in GB"
    rows = reproduction.plan_disk()
    sizes[disk_size(reproduction.whole_disk(rows))] = "reproduction.whole_disk"
    sizes.update({disk_size(row.kept_bytes): f"reproduction.plan_disk: {row.row} keeps" for row in rows})
    return sizes


def test_the_disk_table_is_checkpoint_disk_of_each_recipe():
    from seal.units import disk_size

    for recipe_cell, model, one, export, without, periodic in disk_table():
        recipe = recipe_cell.split("`")[1]
        every = re.search(r"save_freq: (\d+)", periodic)
        disk, saving = disk_of(recipe, 0), disk_of(recipe, int(every[1]) if every else 10)
        assert model.endswith(f"{disk.parameters / 1e9:.2f}B"), (recipe, model)
        assert (one, export) == (disk_size(disk.checkpoint_bytes), disk_size(disk.export_bytes)), recipe
        assert (
            without in ("—", disk_size(disk.total_bytes))
            and periodic.split()[0] == disk_size(saving.total_bytes).split()[0]
        )
    assert len(disk_table()) == 4


@pytest.mark.parametrize("name", ESTIMATED_DOCS)
def test_every_size_a_doc_states_is_an_estimate_that_computes_it(name):
    stated = [m.rstrip(".,") for m in SIZE.findall(hand_written(ROOT / "docs" / name))]
    unknown = [size for size in stated if size.lstrip("~≈") not in estimated_sizes() and size not in NOT_ESTIMATED]
    unknown = [size for size in unknown if size.lstrip("~≈") not in NOT_ESTIMATED]
    assert unknown == [], f"{name}: sizes no estimate computes (add a check, or a NOT_ESTIMATED entry): {unknown}"


def test_the_wall_clock_table_is_the_plans_cost_model(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import reproduce

    reproduce.print_wall_clock()
    table = capsys.readouterr().out.strip()
    assert table in (ROOT / "docs" / "recipes.md").read_text()
    assert len(table.splitlines()) == 2 + 3 * 4  # every backbone on 1, 2, 4 and 8 GPUs


def test_the_kv_capacity_and_gpu_hours_reproduce_md_states():
    from seal.launch.memory_estimate import GIB, estimate
    from seal.report import reproduction

    text = (ROOT / "docs" / "reproduce.md").read_text()
    seal, toolace = (reproduction.composed(f"exp/{r}.yaml") for r in ("SEAL", "toolace2_8b"))
    for config in (seal, toolace):
        assert f"{estimate(config, gpu_bytes=80 * GIB).kv_tokens:,}" in text
    hours = [
        round(reproduction.cost(seal, "train", gpu, assume).gpu_hours)
        for gpu in reproduction.GPU_TYPES
        for assume in reproduction.ASSUMPTIONS
    ]
    assert f"about {hours[0]}–{hours[1]} GPU-hours on 4 H100s and {hours[2]}–{hours[3]} on 4 A100s" in text


# ---- the key reference -------------------------------------------------------------------------------------


def test_the_recipe_reference_is_the_generated_one_and_every_seal_key_has_a_comment():
    from seal.config import reference

    generated = reference.render()
    assert reference.generated_part() == generated, "docs/recipes.md is stale: run `python -m seal.config docs`"
    rows = [line.split(" | ") for line in generated.splitlines() if line.startswith(("| `seal.", "| `env_service."))]
    silent = [row[0] for row in rows if len(row) == 3 and not row[2].strip(" |")]
    assert silent == [], f"seal_defaults.yaml keys without a comment: {silent}"

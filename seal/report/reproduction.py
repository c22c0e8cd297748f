"""The paper's reproduction as one plan of commands, and the same plan rehearsed on CPU.

``plan(out)`` lists what reproduces every number of the paper's tables on a GPU node, in order: train each row's
recipe, evaluate each trained checkpoint and each base model on the held-out tasks, evaluate each Table-1 row out
of distribution, build the tables. Each step is the command a user would type.

``rehearsal(out)`` is that plan with only what cannot exist on a CPU machine swapped: the keys of
``seal/config/swap/cpu.yaml`` (hardware, rollout backend, model, sizes, steps, tasks) added to each training and
evaluation command as ``+swap=cpu``, the tiny model in place of a hub model, a stub endpoint in place of a served
checkpoint, and the task selection and ``--val-file`` that follow the swapped task files. Everything else comes
from the GPU recipe. ``tests/test_reproduce.py`` checks that a rehearsal command differs from its plan command in
nothing else.

Folder layout under ``out`` (``scripts/make_tables.py`` finds rows by folder name):
``runs/<row>__training`` (a training run's ``seal.run_dir``), ``checkpoints/<row>``, ``runs/<row>`` (``seal.eval``
of the row's model), ``runs/<row>__ood`` (its out-of-distribution evaluation), ``tables/``.
"""

from __future__ import annotations

import functools
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from seal.eval import stub_endpoint

REPO = Path(__file__).resolve().parents[2]
SWAP = "+swap=cpu"  # seal/config/swap/cpu.yaml, composed after the recipe
SWAP_FILE = REPO / "seal" / "config" / "swap" / "cpu.yaml"
BASE_RECIPE = "exp/SEAL.yaml"

#: Table 1's backbones: make_tables' row prefix, the recipe that trains full SEAL on it, its hub model.
BACKBONES = {
    "qwen2.5-3b": ("exp/qwen2.5_3b.yaml", "Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b": ("exp/SEAL.yaml", "Qwen/Qwen2.5-7B-Instruct"),
    "toolace2-8b": ("exp/toolace2_8b.yaml", "Team-ACE/ToolACE-2-Llama-3.1-8B"),
}
#: The ablation (Qwen2.5-7B): its rows are the recipes' experiment names; full SEAL and Vanilla RL are Table 1's.
ABLATIONS = ("wo_env_adaptation", "wo_reweighting", "wo_closed_loop")
VANILLA_RECIPE = "exp/vanilla_rl.yaml"

OOD_BFCL = ("memory_kv", "memory_vector", "memory_rec_sum", "web_search_base", "web_search_no_snippet")
OOD_TAU2 = ("tau2_retail", "tau2_airline", "tau2_telecom")
#: The out-of-distribution categories that run offline (no web search key, no sentence-transformers model).
OOD_OFFLINE = ("memory_kv", "memory_rec_sum")
SERVE_PORT = 8000
#: vLLM's tool-call parser for tau2's function calling: Qwen2.5 writes Hermes-style <tool_call> blocks, ToolACE-2
#: Python-style call lists.
TOOL_CALL_PARSERS = {"exp/toolace2_8b.yaml": "pythonic"}

#: Swap values that depend on the backbone, by the recipe's prompt format (the swap file's are Qwen's): a Llama-3.1
#: recipe gets a tiny model with Llama 3.1's special tokens, and 2,048 more prompt tokens, as it has on GPU for its
#: longer tool docs.
BACKBONE_SWAPS = {
    "toolace_llama": {
        "seal.tiny_model.shape": "bfcl_bpe_llama3",
        "seal.tiny_model.out_dir": "outputs/tiny-bfcl-bpe-llama3",
        "actor_rollout_ref.model.path": "outputs/tiny-bfcl-bpe-llama3",
        "data.max_prompt_length": 6144,
        "actor_rollout_ref.rollout.max_model_len": 6656,
    }
}


@dataclass(frozen=True)
class Training:
    """A row trained by ``recipe``, with ``switches`` (another recipe's changes to SEAL.yaml) on top."""

    row: str
    recipe: str
    switches: tuple[str, ...] = ()


@dataclass
class Step:
    """One command of the plan. ``argv`` starts with ``python``; ``kind``: train | eval | serve | ood | tables."""

    kind: str
    row: str
    argv: list[str]
    fills: str
    recipe: str | None = None
    notes: list[str] = field(default_factory=list)

    def command(self) -> str:
        return shlex.join(self.argv)


# ---- the rows --------------------------------------------------------------------------------------


def recipe_switches(recipe: str, base: str = BASE_RECIPE) -> tuple[str, ...]:
    """What ``recipe`` changes in ``base``, as overrides (its experiment name aside): Vanilla RL's switches, to
    apply on a backbone recipe, taken from exp/vanilla_rl.yaml itself so they have one home."""
    from seal.launch import compose_recipe

    ours, theirs = leaves(compose_recipe(str(REPO / recipe))), leaves(compose_recipe(str(REPO / base)))
    changed = {k: v for k, v in ours.items() if theirs.get(k, object()) != v and k != "trainer.experiment_name"}
    return tuple(f"{k}={_override_value(v)}" for k, v in sorted(changed.items()))


def leaves(config) -> dict:
    """{dotted key: value} of every leaf of a config (unresolved: interpolations stay as written)."""
    from omegaconf import OmegaConf

    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(config) if not isinstance(config, dict) else config, "")
    return flat


def _override_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def trainings() -> list[Training]:
    """Every training run of Table 1 and the ablation."""
    vanilla = recipe_switches(VANILLA_RECIPE)
    runs = []
    for backbone, (recipe, _model) in BACKBONES.items():
        runs.append(Training(f"{backbone}__seal", recipe))
        if recipe == BASE_RECIPE:
            runs.append(Training(f"{backbone}__vanilla_rl", VANILLA_RECIPE))
        else:
            runs.append(Training(f"{backbone}__vanilla_rl", recipe, vanilla))
    runs += [Training(name, f"exp/{name}.yaml") for name in ABLATIONS]
    return runs


def table1_rows() -> list[str]:
    return [f"{backbone}__{training}" for backbone in BACKBONES for training in ("base", "vanilla_rl", "seal")]


def fills(row: str) -> str:
    if row in ABLATIONS:
        return f"ablation: {row}"
    backbone, _, training = row.partition("__")
    return f"Table 1: {BACKBONES[backbone][1].split('/')[-1]} {training}" + (
        " (and the ablation's row)" if row in ("qwen2.5-7b__seal", "qwen2.5-7b__vanilla_rl") else ""
    )


# ---- the plan --------------------------------------------------------------------------------------


def layout(out: str) -> dict[str, str]:
    return {"runs": os.path.join(out, "runs"), "checkpoints": os.path.join(out, "checkpoints")}


def train_argv(run: Training, out: str) -> list[str]:
    where = layout(out)
    return [
        "python",
        "launcher.py",
        "--conf",
        run.recipe,
        *run.switches,
        f"trainer.experiment_name={run.row}",
        f"seal.run_dir={where['runs']}/{run.row}__training",
        f"trainer.default_local_dir={where['checkpoints']}/{run.row}",
    ]


def eval_argv(row: str, recipe: str, model: str, out: str, switches: tuple[str, ...] = ()) -> list[str]:
    dest = f"{layout(out)['runs']}/{row}"
    argv = ["python", "-m", "seal.eval", "checkpoint", "--conf", recipe, "--model", model, "--out", dest]
    return argv + ["--", *switches] if switches else argv


def ood_argvs(row: str, endpoint: str, model: str, out: str, recipe: str, bfcl: tuple[str, ...]) -> list[list[str]]:
    dest = f"{layout(out)['runs']}/{row}__ood"
    common = ["python", "-m", "seal.eval", "endpoint", "--endpoint", endpoint, "--model", model, "--out", dest]
    if recipe == BACKBONES["toolace2-8b"][0]:
        common += ["--tool-prompt-mode", "toolace_llama"]
    return [
        [*common, "--categories", ",".join(bfcl)],
        [*common, "--user-endpoint", "USER_ENDPOINT", "--user-model", "USER_MODEL", "--categories", ",".join(OOD_TAU2)],
    ]


def plan(out: str = "experiments/paper") -> list[Step]:
    """The GPU reproduction, in order."""
    runs = trainings()
    by_row = {run.row: run for run in runs}
    steps = [Step("train", run.row, train_argv(run, out), fills(run.row), run.recipe) for run in runs]
    for row in table1_rows() + list(ABLATIONS):
        backbone, _, training = row.partition("__")
        if training == "base":
            recipe, model = BACKBONES[backbone]
            steps.append(Step("eval", row, eval_argv(row, recipe, model, out), fills(row), recipe))
        else:
            run = by_row[row]
            best = f"{layout(out)['checkpoints']}/{row}/best"
            steps.append(Step("eval", row, eval_argv(row, run.recipe, best, out, run.switches), fills(row), run.recipe))
    for row in table1_rows():
        backbone, _, training = row.partition("__")
        recipe, hub = BACKBONES[backbone]
        model = hub if training == "base" else f"{layout(out)['checkpoints']}/{row}/best/huggingface"
        serve = ["vllm", "serve", model, "--served-model-name", row, "--port", str(SERVE_PORT)]
        serve += ["--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSERS.get(recipe, "hermes")]
        serve += ["--max-model-len", "32768"]
        ood = f"OOD: {fills(row).removeprefix('Table 1: ')}"
        steps.append(Step("serve", row, serve, ood, recipe))
        endpoint = f"http://127.0.0.1:{SERVE_PORT}/v1"
        steps += [Step("ood", row, argv, ood, recipe) for argv in ood_argvs(row, endpoint, row, out, recipe, OOD_BFCL)]
    tables = ["python", "scripts/make_tables.py", layout(out)["runs"], "--out", os.path.join(out, "tables")]
    steps.append(Step("tables", "", tables, "Table 1, the ablation, the OOD table, accuracy_over_steps.png"))
    return steps


# ---- GPU-hours -------------------------------------------------------------------------------------

#: The estimate's assumptions (not measurements; docs/reproduce.md): an episode's sequence reaches
#: SEQUENCE_SHARE of the recipe's max_model_len, of which GENERATED_SHARE is generated; training runs 10 FLOPs per
#: parameter and token (actor forward and backward 6, old-policy and reference forwards 2 each) at TRAIN_MFU of
#: an H100's dense bf16 peak; vLLM decodes DECODE_TOKENS_PER_S tokens a second per GPU for a 7B model, inversely
#: with model size.
SEQUENCE_SHARE = 0.5
GENERATED_SHARE = 0.25
PEAK_FLOPS = 989e12
TRAIN_MFU = 0.3
DECODE_TOKENS_PER_S = 2000.0
DECODE_REFERENCE_PARAMETERS = 7.6e9


@dataclass(frozen=True)
class Cost:
    """What a step runs (training steps, episodes) and its estimated GPU-hours."""

    steps: int
    train_episodes: int
    val_episodes: int
    gpu_hours: float
    gpus: int


def training_steps(config) -> int:
    from seal.launch.memory_estimate import data_rows

    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    rows = data_rows(config.data.train_files, REPO)
    return int(config.trainer.total_epochs) * (rows // int(config.data.train_batch_size))  # verl drops the last


def validations(config, steps: int) -> int:
    freq = int(config.trainer.test_freq)
    periodic = steps // freq + (steps % freq != 0) if freq > 0 else 0  # verl also validates after the last step
    return int(bool(config.trainer.val_before_train)) + periodic


def cost(config, kind: str) -> Cost | None:
    """The estimate for a ``train`` or ``eval`` step's composed config; None when the model's size is unknown."""
    from seal.launch.memory_estimate import data_rows, model_shape

    found = model_shape(str(config.actor_rollout_ref.model.path))
    if found is None:
        return None
    parameters = found[0].parameters
    sequence = SEQUENCE_SHARE * int(config.actor_rollout_ref.rollout.max_model_len)
    val_rows = data_rows(config.data.val_files, REPO)
    if kind == "train":
        steps = training_steps(config)
        train_episodes = steps * int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        val_episodes = validations(config, steps) * val_rows
    else:
        steps, train_episodes, val_episodes = 0, 0, val_rows
    train_s = train_episodes * sequence * parameters * 10 / (PEAK_FLOPS * TRAIN_MFU)
    decode_rate = DECODE_TOKENS_PER_S * DECODE_REFERENCE_PARAMETERS / parameters
    decode_s = (train_episodes + val_episodes) * sequence * GENERATED_SHARE / decode_rate
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    return Cost(steps, train_episodes, val_episodes, (train_s + decode_s) / 3600, gpus)


# ---- the rehearsal ---------------------------------------------------------------------------------


def swap_values() -> dict:
    """The swap file's keys (dotted) and values."""
    return dict(_swap_file())


@functools.cache
def _swap_file() -> dict:
    from omegaconf import OmegaConf

    return leaves(OmegaConf.load(SWAP_FILE))


@functools.cache
def _prompt_mode(recipe: str) -> str:
    from seal.launch import compose_recipe

    return str(compose_recipe(str(REPO / recipe)).env_service.bfcl.tool_prompt_mode)


def backbone_swaps(recipe: str) -> dict:
    """The swap's values for ``recipe``'s backbone (its keys are all the swap file's)."""
    return {**swap_values(), **BACKBONE_SWAPS.get(_prompt_mode(recipe), {})}


def tiny_model(recipe: str) -> tuple[str, str]:
    """(shape, folder) of the tiny model standing in for ``recipe``'s backbone."""
    swap = backbone_swaps(recipe)
    return swap["seal.tiny_model.shape"], swap["seal.tiny_model.out_dir"]


def backbone_overrides(recipe: str) -> list[str]:
    """The backbone's swap values that differ from the swap file's, as overrides."""
    default, ours = swap_values(), backbone_swaps(recipe)
    return [f"{k}={v}" for k, v in ours.items() if default[k] != v]


def heldout_ids() -> list[str]:
    """The swap's held-out tasks: what a rehearsal evaluates in place of the 400."""
    import pyarrow.parquet as pq

    rows = pq.read_table(str(REPO / swap_values()["data.val_files"]), columns=["extra_info"]).column("extra_info")
    return [row["task_id"] for row in rows.to_pylist()]


def rehearse_step(step: Step, stub_url: str, training_steps: int | None = None, tau2: bool = True) -> Step | None:
    """``step`` on CPU: the plan's command with only the swaps added (None: nothing to run here)."""
    argv = list(step.argv)
    if step.kind == "train":
        argv += [SWAP, *backbone_overrides(step.recipe)]
        if training_steps is not None:
            argv.append(f"trainer.total_training_steps={int(training_steps)}")
    elif step.kind == "eval":
        if not argv[argv.index("--model") + 1].endswith("/best"):  # a base model: the untrained tiny model
            argv[argv.index("--model") + 1] = tiny_model(step.recipe)[1]
        overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
        argv = argv[: argv.index("--")] if "--" in argv else argv
        argv += ["--ids", ",".join(heldout_ids()), "--no-progress", "--", SWAP, *overrides]
        argv += [o for o in backbone_overrides(step.recipe) if not o.startswith("actor_rollout_ref.model.path=")]
    elif step.kind == "serve":
        return None  # the stub endpoint stands in for vLLM serving the checkpoint
    elif step.kind == "ood":
        tau2_step = "--user-endpoint" in argv
        if tau2_step and not tau2:
            return None
        argv[argv.index("--endpoint") + 1] = stub_url
        argv[argv.index("--model") + 1] = stub_endpoint.AGENT_MODEL
        if tau2_step:
            argv[argv.index("--user-endpoint") + 1] = stub_url
            argv[argv.index("--user-model") + 1] = stub_endpoint.USER_MODEL
        else:
            argv[argv.index("--categories") + 1] = ",".join(OOD_OFFLINE)
        argv += ["--limit", "1", "--no-progress"]
    elif step.kind == "tables":
        argv += ["--val-file", swap_values()["data.val_files"]]
    return Step(step.kind, step.row, argv, step.fills, step.recipe)


#: What a rehearsal may change on a command line besides the swap's Hydra keys, by kind of command: a base model
#: becomes the untrained tiny model and the 400 held-out tasks the swap's (eval); the stub endpoint serves, and
#: plays tau2's user, on the categories that run offline, one task each (ood); the tables read the swap's
#: validation file (tables).
COMMAND_SWAPS = {
    "train": (),
    "eval": ("--model", "--ids", "--no-progress"),
    "ood": ("--endpoint", "--model", "--user-endpoint", "--user-model", "--categories", "--limit", "--no-progress"),
    "tables": ("--val-file",),
}

#: Rows whose out-of-distribution evaluation a rehearsal runs: the stub endpoint answers alike for every row.
REHEARSAL_OOD_ROWS = ("qwen2.5-7b__seal",)


def rehearsal(out: str, stub_url: str, rows: list[str] | None = None, training_steps: int | None = None) -> list[Step]:
    """The rehearsal's commands: the plan's, swapped, for ``rows`` (default: all)."""
    from seal.eval.tau2 import tau2_python

    tau2 = tau2_python() is not None
    chosen = []
    for step in plan(out):
        if rows is not None and step.kind != "tables" and step.row not in rows:
            continue
        if step.kind == "ood" and step.row not in REHEARSAL_OOD_ROWS:
            continue
        swapped = rehearse_step(step, stub_url, training_steps, tau2)
        if swapped is not None:
            chosen.append(swapped)
    return chosen


def chains(steps: list[Step]) -> list[list[Step]]:
    """The steps grouped into chains that can run side by side: each row's training then its evaluations; the
    tables come last, alone."""
    by_row: dict[str, list[Step]] = {}
    for step in steps:
        if step.kind != "tables":
            by_row.setdefault(step.row, []).append(step)
    return [*by_row.values(), [s for s in steps if s.kind == "tables"]]


def run_rehearsal(out: str, rows: list[str] | None = None, training_steps: int | None = None, jobs: int = 1) -> int:
    """Run the rehearsal's commands, ``jobs`` rows at a time, each command logged under ``out/logs``; a row stops
    at its first failing command. Returns 0, or the exit status of a command that failed."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from seal.cpu.tiny_model import build_tiny_model

    out = os.path.abspath(out)
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for shape, folder in {tiny_model(r) for r in {s[0] for s in BACKBONES.values()}}:
        build_tiny_model(REPO / folder, seed=int(swap_values()["seal.tiny_model.seed"]), shape=shape)  # base evals
    with stub_endpoint.StubEndpoint() as stub:
        steps = rehearsal(out, stub.url, rows, training_steps)
        numbered = {id(step): i for i, step in enumerate(steps, 1)}
        *parallel, last = chains(steps)

        def run_chain(chain: list[Step]) -> int:
            for step in chain:
                status = _run_step(step, numbered[id(step)], len(steps), logs)
                if status != 0:
                    return status
            return 0

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            failed = [status for status in pool.map(run_chain, parallel) if status != 0]
        if failed:
            print(f"[reproduce] error: {len(failed)} row(s) failed; see the logs above", file=sys.stderr)
            return failed[0]
        return run_chain(last)


def _run_step(step: Step, number: int, total: int, logs: Path) -> int:
    import subprocess
    import sys
    import time

    log = logs / f"{number:02d}_{step.kind}_{step.row or 'all'}.log"
    print(f"[reproduce] {number}/{total} {step.kind} {step.row} ({step.fills}) -> {log}", flush=True)
    argv = [sys.executable if step.argv[0] == "python" else step.argv[0], *step.argv[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(shlex.join(argv) + "\n\n")
        f.flush()
        status = subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    print(f"[reproduce] {number}/{total} exit {status} after {time.monotonic() - start:.0f} s", flush=True)
    if status != 0:
        print(f"[reproduce] error: {step.command()} failed; see {log}", file=sys.stderr)
    return status

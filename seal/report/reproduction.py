"""The paper's reproduction as one plan of commands, and the same plan rehearsed on CPU.

``plan(out)`` lists what reproduces every number of the paper's tables on a GPU node, in order: train each row's
recipe, evaluate each trained run's best checkpoint (selected on the held-out tasks it is then scored on: the paper's
protocol, compared with the paper) and its last checkpoint (selected by nothing: the unbiased score) and each base
model on the held-out tasks, evaluate each row of the paper's OOD table out of distribution, build the tables. Each
step is the command a user would type. Besides the paper's rows it trains one extra row, SEAL as the paper describes
it (:data:`PAPER_METHOD`), which has its own line in Table 1 and no paper cell to be compared with.

``rehearsal(out)`` is that plan with only what cannot exist on a CPU machine swapped: the keys of
``seal/config/swap/cpu.yaml`` (hardware, rollout backend, model, sizes, steps, tasks) added to each training and
evaluation command as ``+swap=cpu``, the tiny model in place of a hub model, a stub endpoint in place of a served
checkpoint, and the task selection and ``--val-file`` that follow the swapped task files. Everything else comes
from the GPU recipe. ``tests/eval/test_reproduce.py`` checks that a rehearsal command differs from its plan command in
nothing else.

Folder layout under ``out`` (``scripts/make_tables.py`` finds rows by folder name):
``runs/<row>__training`` (a training run's ``seal.run_dir``), ``checkpoints/<row>``, ``runs/<row>`` (``seal.eval``
of the row's model: its best checkpoint for a trained row), ``runs/<row>__last`` (of its last checkpoint),
``runs/<row>__ood`` (its out-of-distribution evaluation), ``tables/``.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

#: The extra row: SEAL as the paper describes it (schema cues, recovery feedback and capability cues; the released
#: recipe, and so every other SEAL row, has schema cues only), on Qwen2.5-7B. The paper has no cell for it.
PAPER_METHOD = "qwen2.5-7b__seal_paper_method"
PAPER_METHOD_RECIPE = "exp/SEAL_interface_evolution.yaml"
#: The folder suffix of a trained row's last-checkpoint evaluation (``runs/<row>`` holds its best checkpoint's).
LAST_SUFFIX = "__last"

OOD_BFCL = ("memory_kv", "memory_vector", "memory_rec_sum", "web_search_base", "web_search_no_snippet")
OOD_TAU2 = ("tau2_retail", "tau2_airline", "tau2_telecom")
#: The out-of-distribution categories that run offline (no web search key, no sentence-transformers model).
OOD_OFFLINE = ("memory_kv", "memory_rec_sum")
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
    """One command of the plan. ``argv`` starts with ``python``; ``kind``: train | eval | ood | tables."""

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
    ours, theirs = leaves(composed(recipe)), leaves(composed(base))
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
    return [*runs, Training(PAPER_METHOD, PAPER_METHOD_RECIPE)]


def table1_rows() -> list[str]:
    return [f"{backbone}__{training}" for backbone in BACKBONES for training in ("base", "vanilla_rl", "seal")]


def rows() -> list[str]:
    """Every row the plan trains or evaluates: Table 1's, the ablation's, the paper-method row."""
    return [*table1_rows(), *ABLATIONS, PAPER_METHOD]


def ood_rows() -> list[str]:
    """The rows of the paper's OOD table (the Qwen backbones'): the ToolACE rows fill no OOD cell, so the plan does
    not evaluate them out of distribution."""
    from seal import paper_numbers

    names = {hub.split("/")[-1]: backbone for backbone, (_recipe, hub) in BACKBONES.items()}
    return [f"{names[backbone]}__{training}" for backbone, training in paper_numbers.OOD]


def fills(row: str) -> str:
    if row == PAPER_METHOD:
        return "Table 1, extra row: Qwen2.5-7B-Instruct + SEAL, as the paper describes it (no paper cell)"
    if row in ABLATIONS:
        return f"Table 3 (ablation): {row}"
    backbone, _, training = row.partition("__")
    return f"Table 1: {BACKBONES[backbone][1].split('/')[-1]} {training}" + (
        " (and the ablation's row)" if row in ("qwen2.5-7b__seal", "qwen2.5-7b__vanilla_rl") else ""
    )


def eval_fills(row: str, checkpoint: str) -> str:
    """What a trained row's evaluation of its ``best`` or ``last`` checkpoint fills."""
    if checkpoint == "best":
        return f"{fills(row)}; best checkpoint (selected on these tasks: the paper's protocol)"
    return f"{fills(row)}; last checkpoint (unbiased)"


# ---- the plan --------------------------------------------------------------------------------------


def layout(out: str) -> dict[str, str]:
    return {"runs": os.path.join(out, "runs"), "checkpoints": os.path.join(out, "checkpoints")}


#: The keys a training command sets for its row (names, folders, when to save), besides the recipe's switches.
RUN_KEYS = ("trainer.experiment_name", "seal.run_dir", "trainer.default_local_dir", "trainer.save_freq")


def train_argv(run: Training, out: str) -> list[str]:
    """The launcher command of a training row; ``trainer.save_freq`` at the run's step count saves its last step
    (verl saves the last step whenever save_freq is positive), which the recipes' 0 does not: the last checkpoint's
    unbiased evaluation needs it."""
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
        f"trainer.save_freq={_planned_steps(run.recipe, run.switches)}",
    ]


def _planned_steps(recipe: str, switches: tuple[str, ...]) -> int:
    return training_steps(composed(recipe, switches))


@functools.cache
def composed(recipe: str, switches: tuple[str, ...] = ()):
    """``recipe`` composed with ``switches`` (once: the plan's rows share recipes; read it, do not change it)."""
    from seal.launch.recipe import compose_recipe

    return compose_recipe(str(REPO / recipe), list(switches))


def eval_argv(row: str, recipe: str, model: str, out: str, switches: tuple[str, ...] = ()) -> list[str]:
    dest = f"{layout(out)['runs']}/{row}"
    argv = ["python", "-m", "seal.eval", "checkpoint", "--conf", recipe, "--model", model, "--out", dest]
    return argv + ["--", *switches] if switches else argv


def ood_argv(row: str, model: str, out: str, recipe: str) -> list[str]:
    """One row's out-of-distribution evaluation: its checkpoint (or hub model) served with vLLM for the command's
    length (``seal.eval endpoint --serve``: started, watched and stopped there), BFCL V4's categories and tau2-bench."""
    dest = f"{layout(out)['runs']}/{row}__ood"
    argv = ["python", "-m", "seal.eval", "endpoint", "--serve", model, "--model", row, "--out", dest]
    argv += ["--tool-call-parser", TOOL_CALL_PARSERS.get(recipe, "hermes")]
    if recipe == BACKBONES["toolace2-8b"][0]:
        argv += ["--tool-prompt-mode", "toolace_llama"]
    argv += ["--user-endpoint", "USER_ENDPOINT", "--user-model", "USER_MODEL"]
    return argv + ["--categories", ",".join(OOD_BFCL + OOD_TAU2)]


def plan(out: str = "experiments/paper") -> list[Step]:
    """The GPU reproduction, in order."""
    runs = trainings()
    by_row = {run.row: run for run in runs}
    steps = [Step("train", run.row, train_argv(run, out), fills(run.row), run.recipe) for run in runs]
    for row in rows():
        backbone, _, training = row.partition("__")
        if training == "base":
            recipe, model = BACKBONES[backbone]
            steps.append(Step("eval", row, eval_argv(row, recipe, model, out), fills(row), recipe))
            continue
        run = by_row[row]
        checkpoints = f"{layout(out)['checkpoints']}/{row}"
        # best: the `best` link; last: the checkpoint folder, whose latest checkpoint seal.eval resolves
        for name, model, checkpoint in ((row, f"{checkpoints}/best", "best"), (row + LAST_SUFFIX, checkpoints, "last")):
            argv = eval_argv(name, run.recipe, model, out, run.switches)
            steps.append(Step("eval", name, argv, eval_fills(row, checkpoint), run.recipe))
    for row in ood_rows():
        backbone, _, training = row.partition("__")
        recipe, hub = BACKBONES[backbone]
        model = hub if training == "base" else f"{layout(out)['checkpoints']}/{row}/best/huggingface"
        ood = f"OOD: {fills(row).removeprefix('Table 1: ')}"
        steps.append(Step("ood", row, ood_argv(row, model, out, recipe), ood, recipe))
    tables = ["python", "scripts/make_tables.py", layout(out)["runs"], "--out", os.path.join(out, "tables")]
    steps.append(Step("tables", "", tables, "Table 1, Table 3 (the ablation), the OOD table, accuracy_over_steps.png"))
    return steps


# ---- disk ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowDisk:
    """A training row's checkpoints on disk (``memory_estimate.checkpoint_disk`` of its command's config, with the
    ``trainer.save_freq`` the plan sets): at the run's peak, and what it keeps for its evaluations once it ends (its
    best and its last checkpoint, and the best's Hugging Face export)."""

    row: str
    disk: Any  # memory_estimate.CheckpointDisk

    @property
    def peak_bytes(self) -> int:
        return self.disk.total_bytes

    @property
    def kept_bytes(self) -> int:
        return 2 * self.disk.checkpoint_bytes + self.disk.export_bytes


def plan_disk(out: str = "experiments/paper") -> list[RowDisk]:
    """Every training row's checkpoint disk, in the plan's order."""
    from seal.launch.memory_estimate import checkpoint_disk

    found = []
    for run in trainings():
        config = copy.deepcopy(composed(run.recipe, run.switches))
        save = next(a for a in train_argv(run, out) if a.startswith("trainer.save_freq="))
        config.trainer.save_freq = int(save.partition("=")[2])  # as the plan's command sets it
        found.append(RowDisk(run.row, checkpoint_disk(config)))
    return found


def whole_disk(rows: list[RowDisk]) -> int:
    """The reproduction's checkpoint disk at its peak: the rows trained one after another, each keeping its best and
    last checkpoint for its evaluations, and the row in training at its own peak (one more checkpoint)."""
    return sum(r.kept_bytes for r in rows) + max(r.peak_bytes - r.kept_bytes for r in rows)


# ---- GPU-hours -------------------------------------------------------------------------------------------------

#: FLOPs per parameter and token of a training step: the actor's forward (2) and backward (4), the old-policy and
#: reference log-probabilities (2 each), and the actor's forward again in backward under gradient checkpointing (2).
TRAIN_FLOPS_PER_PARAMETER = 10
RECOMPUTE_FLOPS_PER_PARAMETER = 2


@dataclass(frozen=True)
class GpuType:
    """A GPU the estimate is made for: dense bf16 peak (FLOP/s), memory bandwidth (bytes/s), memory (GiB)."""

    name: str
    peak_flops: float
    bandwidth: float
    memory_gib: float


#: The recipes ask for 80 GB GPUs; these are the two common ones (SXM parts, vendors' datasheets).
GPU_TYPES = (GpuType("H100 80GB SXM", 989e12, 3.35e12, 80.0), GpuType("A100 80GB SXM", 312e12, 2.039e12, 80.0))


@dataclass(frozen=True)
class Assumptions:
    """One end of the estimate's range: what is not in a recipe, assumed (docs/reproduce.md says why each)."""

    name: str
    mfu: float  # share of the dense peak that training and prefill reach
    bandwidth_share: float  # share of memory bandwidth a decode step reaches (enforce_eager: no CUDA graphs)
    sequence_share: float  # an episode's final context, as a share of max_model_len
    generated_share: float  # generated tokens, as a share of that context
    model_calls: int  # per episode; each call prefills its context again, less what vLLM's prefix cache holds
    prefix_cache_hit: float  # share of an earlier context the prefix cache still holds (preemption evicts it)
    sync_s: float  # per training step: weights to vLLM, vLLM's sleep and wake
    environment_s: float  # per training step: environment time that generation does not hide
    save_bytes_per_s: float  # checkpoint write speed
    saves: str  # "last": the last step and one best; "every": also a new best at every validation
    startup_s: float  # Ray, the environment service, model loading, vLLM start-up


ASSUMPTIONS = (
    Assumptions("low", 0.40, 0.6, 0.4, 0.25, 6, 0.8, 20.0, 10.0, 2e9, "last", 600.0),
    Assumptions("high", 0.25, 0.3, 0.6, 0.25, 12, 0.0, 60.0, 60.0, 0.5e9, "every", 1200.0),
)


@dataclass(frozen=True)
class Decode:
    """Decode on one rollout replica, derived from the recipe's KV cache (``launcher.py --dry-run``'s numbers)."""

    kv_tokens: int  # the KV cache's capacity per replica
    sequences: int  # a phase's sequences per replica
    at_once: int  # of them running at once: within max_num_seqs and what the KV cache holds at ``context``
    context: int  # tokens an episode holds in the KV cache
    tokens_per_s: float  # per replica


@dataclass(frozen=True)
class Cost:
    """What a step runs (training steps, episodes) and its estimated GPU-hours on one GPU type and one end of the
    range, with the decode it assumed."""

    steps: int
    train_episodes: int
    val_episodes: int
    gpu_hours: float
    gpus: int
    gpu: GpuType
    assumptions: Assumptions
    decode: Decode
    flops_per_parameter: int
    step_s: float  # wall-clock seconds of one training step (rollout, update, sync, environment); 0 for eval
    wall_s: float  # wall-clock seconds of the whole run: start-up, steps, validations, saves


def training_steps(config) -> int:
    from seal.launch.memory_estimate import training_steps as steps_of

    return steps_of(config, REPO)


def validations(config, steps: int) -> int:
    freq = int(config.trainer.test_freq)
    periodic = steps // freq + (steps % freq != 0) if freq > 0 else 0  # verl also validates after the last step
    return int(bool(config.trainer.val_before_train)) + periodic


def decode_rate(found, sequences: int, context: int, max_num_seqs: int, gpu: GpuType, share: float) -> Decode:
    """Decode is memory-bound: a step reads the replica's weights once and the KV of every running sequence, and
    yields one token per running sequence; what runs at once is what the KV cache holds at ``context`` tokens each."""
    at_once = max(1, min(sequences, max_num_seqs, found.kv_tokens // max(context, 1)))
    step_bytes = found.vllm_weight_bytes + at_once * context * found.kv_bytes_per_token / found.tensor_parallel
    return Decode(found.kv_tokens, sequences, at_once, context, at_once * gpu.bandwidth * share / step_bytes)


def cost(config, kind: str, gpu: GpuType = GPU_TYPES[0], assume: Assumptions = ASSUMPTIONS[0]) -> Cost | None:
    """The estimate for a ``train`` or ``eval`` step's composed config on ``gpu`` under ``assume``; None when the
    model's size is unknown. Wall-clock time of the run times its GPUs."""
    from seal.launch.memory_estimate import GIB, checkpoint_disk, data_rows, estimate

    found = estimate(config, gpu_bytes=gpu.memory_gib * GIB)
    if found is None:
        return None
    aro = config.actor_rollout_ref
    gpus, parameters = found.gpus, found.parameters
    context = int(assume.sequence_share * found.max_model_len)
    generated = int(assume.generated_share * context)
    # each model call after the first prefills the context so far (on average half the final one) again, less what
    # the prefix cache still holds; the context's own tokens that are not generated are prefilled once
    prefill = context - generated + (assume.model_calls - 1) * context / 2 * (1 - assume.prefix_cache_hit)
    flops_rate = gpus * gpu.peak_flops * assume.mfu
    recompute = RECOMPUTE_FLOPS_PER_PARAMETER if aro.model.get("enable_gradient_checkpointing") else 0
    flops = TRAIN_FLOPS_PER_PARAMETER + recompute

    def rollout_s(episodes: int) -> tuple[float, Decode]:
        replicas = found.replicas
        per_replica = math.ceil(episodes / replicas)
        rate = decode_rate(found, per_replica, context, int(aro.rollout.max_num_seqs), gpu, assume.bandwidth_share)
        return episodes * prefill * 2 * parameters / flops_rate + per_replica * generated / rate.tokens_per_s, rate

    val_rows = data_rows(config.data.val_files, REPO) * int(aro.rollout.val_kwargs.n)
    val_s, _ = rollout_s(val_rows)
    if kind == "train":
        steps = training_steps(config)
        episodes = int(config.data.train_batch_size) * int(aro.rollout.n)
        step_rollout_s, rate = rollout_s(episodes)
        train_s = episodes * context * parameters * flops / flops_rate
        step_s = step_rollout_s + train_s + assume.sync_s + assume.environment_s
        checks = validations(config, steps)
        saves = 2 if assume.saves == "last" else checks + 1
        disk = checkpoint_disk(config)  # what a save writes, and the best checkpoint's Hugging Face export
        wall = assume.startup_s + steps * step_s + checks * val_s
        wall += (saves * disk.checkpoint_bytes + disk.export_bytes) / assume.save_bytes_per_s
        train_episodes, val_episodes = steps * episodes, checks * val_rows
    else:
        steps, train_episodes, val_episodes, step_s = 0, 0, val_rows, 0.0
        _, rate = rollout_s(val_rows)
        wall = assume.startup_s + val_s
    return Cost(steps, train_episodes, val_episodes, wall * gpus / 3600, gpus, gpu, assume, rate, flops, step_s, wall)


#: The GPU counts the wall-clock table is made for (one node).
WALL_CLOCK_GPUS = (1, 2, 4, 8)


@dataclass(frozen=True)
class WallClock:
    """A recipe on ``gpus`` GPUs of one type: the low and high ends of its step and run time, and whether the memory
    estimate fits that GPU (rollout and training peak)."""

    recipe: str
    gpus: int
    gpu: GpuType
    low: Cost
    high: Cost
    fits: bool


def wall_clock(recipe: str, gpus: int, gpu: GpuType) -> WallClock:
    """``recipe`` trained on one node of ``gpus`` GPUs (``trainer.n_gpus_per_node``), by :func:`cost`."""
    from seal.launch.memory_estimate import GIB, estimate

    config = copy.deepcopy(composed(recipe))
    config.trainer.n_gpus_per_node = gpus
    low, high = (cost(config, "train", gpu, assume) for assume in ASSUMPTIONS)
    found = estimate(config, gpu_bytes=gpu.memory_gib * GIB)
    fits = found.rollout_total_bytes <= found.gpu_bytes and found.training.total_bytes <= found.gpu_bytes
    return WallClock(recipe, gpus, gpu, low, high, fits)


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
    from seal.launch.recipe import compose_recipe

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


def rehearse_step(step: Step, stub_url: str, training_steps: int | None = None, tau2: bool = True) -> Step:
    """``step`` on CPU: the plan's command with only the swaps added."""
    argv = list(step.argv)
    if step.kind == "train":
        argv += [SWAP, *backbone_overrides(step.recipe)]
        if training_steps is not None:
            argv.append(f"trainer.total_training_steps={int(training_steps)}")
    elif step.kind == "eval":
        if step.row.endswith("__base"):  # a base model: the untrained tiny model
            argv[argv.index("--model") + 1] = tiny_model(step.recipe)[1]
        overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
        argv = argv[: argv.index("--")] if "--" in argv else argv
        argv += ["--ids", ",".join(heldout_ids()), "--no-progress", "--", SWAP, *overrides]
        argv += [o for o in backbone_overrides(step.recipe) if not o.startswith("actor_rollout_ref.model.path=")]
    elif step.kind == "ood":
        at = argv.index("--serve")
        argv[at : at + 2] = ["--endpoint", stub_url]  # the stub endpoint stands in for vLLM serving the checkpoint
        argv += ["--tokenizer", tiny_model(step.recipe)[1]]  # the checkpoint's tokenizer: its tiny model's
        at = argv.index("--tool-call-parser")
        del argv[at : at + 2]
        argv[argv.index("--model") + 1] = stub_endpoint.AGENT_MODEL
        argv[argv.index("--user-endpoint") + 1] = stub_url
        argv[argv.index("--user-model") + 1] = stub_endpoint.USER_MODEL
        argv[argv.index("--categories") + 1] = ",".join(OOD_OFFLINE + (OOD_TAU2 if tau2 else ()))
        argv += ["--limit", "1", "--no-progress"]
    elif step.kind == "tables":
        argv += ["--val-file", swap_values()["data.val_files"]]
    return Step(step.kind, step.row, argv, step.fills, step.recipe)


#: What a rehearsal may change on a command line besides the swap's Hydra keys, by kind of command: a base model
#: becomes the untrained tiny model and the 400 held-out tasks the swap's (eval); the stub endpoint, already up,
#: stands in for the served checkpoint (no --serve, no vLLM tool-call parser; the checkpoint's tokenizer named) and
#: plays tau2's user, on the categories that run offline, one task each (ood); the tables read the swap's validation
#: file (tables).
COMMAND_SWAPS = {
    "train": (),
    "eval": ("--model", "--ids", "--no-progress"),
    "ood": (
        "--serve",
        "--tool-call-parser",
        "--endpoint",
        "--tokenizer",
        "--model",
        "--user-endpoint",
        "--user-model",
        "--categories",
        "--limit",
        "--no-progress",
    ),
    "tables": ("--val-file",),
}

#: Rows whose out-of-distribution evaluation a rehearsal runs: the stub endpoint answers alike for every row.
REHEARSAL_OOD_ROWS = ("qwen2.5-7b__vanilla_rl",)


def rehearsal(out: str, stub_url: str, rows: list[str] | None = None, training_steps: int | None = None) -> list[Step]:
    """The rehearsal's commands: the plan's, swapped, for ``rows`` (default: all)."""
    from seal.eval.tau2 import tau2_python

    tau2 = tau2_python() is not None
    chosen = []
    for step in plan(out):
        if rows is not None and step.kind != "tables" and step.row.removesuffix(LAST_SUFFIX) not in rows:
            continue
        if step.kind == "ood" and step.row not in REHEARSAL_OOD_ROWS:
            continue
        chosen.append(rehearse_step(step, stub_url, training_steps, tau2))
    return chosen


def chains(steps: list[Step]) -> list[list[Step]]:
    """The steps grouped into chains that can run side by side: each row's training then its evaluations (of its
    best and its last checkpoint); the tables come last, alone."""
    by_row: dict[str, list[Step]] = {}
    for step in steps:
        if step.kind != "tables":
            by_row.setdefault(step.row.removesuffix(LAST_SUFFIX), []).append(step)
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
    threads = job_threads(jobs)
    with stub_endpoint.StubEndpoint() as stub:
        steps = rehearsal(out, stub.url, rows, training_steps)
        numbered = {id(step): i for i, step in enumerate(steps, 1)}
        *parallel, last = chains(steps)

        def run_chain(chain: list[Step]) -> int:
            for step in chain:
                if share_best_evaluation(step, chain):
                    continue
                status = _run_step(step, numbered[id(step)], len(steps), logs, threads)
                if status != 0:
                    return status
            return 0

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            failed = [status for status in pool.map(run_chain, parallel) if status != 0]
        if failed:
            print(f"[reproduce] error: {len(failed)} row(s) failed; see the logs above", file=sys.stderr)
            return failed[0]
        return run_chain(last)


def job_threads(jobs: int) -> dict[str, str]:
    """What each of ``jobs`` rows rehearsed side by side adds to its commands' environment: its share of the cores
    as torch threads. A CPU run otherwise takes every core (``seal.cpu.platform.worker_threads``), and rows side by
    side would oversubscribe them many times over. A user's ``OMP_NUM_THREADS`` wins."""
    from seal.cpu.platform import worker_threads

    if jobs <= 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int(worker_threads()) // jobs))}


def share_best_evaluation(step: Step, chain: list[Step]) -> bool:
    """A last-checkpoint evaluation whose checkpoint is the best one (a run whose last step was its best, as in a
    one-step rehearsal) shares the best's evaluation, already run in ``chain``: its folder links to the best's."""
    from seal.eval.checkpoint import resolve_model

    if step.kind != "eval" or not step.row.endswith(LAST_SUFFIX):
        return False
    best = next(s for s in chain if s.kind == "eval" and s.row == step.row.removesuffix(LAST_SUFFIX))

    def checkpoint(s: Step) -> str:
        return os.path.realpath(resolve_model(s.argv[s.argv.index("--model") + 1]))

    if checkpoint(step) != checkpoint(best):
        return False
    folder, shared = (Path(s.argv[s.argv.index("--out") + 1]) for s in (step, best))
    if not folder.exists():
        folder.symlink_to(shared.name)
    print(f"[reproduce] {step.row}: the last checkpoint is the best one ({checkpoint(step)}); {folder} shares {shared}")
    return True


def _run_step(step: Step, number: int, total: int, logs: Path, threads: dict[str, str]) -> int:
    import subprocess
    import sys
    import time

    log = logs / f"{number:02d}_{step.kind}_{step.row or 'all'}.log"
    print(f"[reproduce] {number}/{total} {step.kind} {step.row} ({step.fills}) -> {log}", flush=True)
    argv = [sys.executable if step.argv[0] == "python" else step.argv[0], *step.argv[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **threads}
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(shlex.join(argv) + "\n\n")
        f.flush()
        status = subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    print(f"[reproduce] {number}/{total} exit {status} after {time.monotonic() - start:.0f} s", flush=True)
    if status != 0:
        print(f"[reproduce] error: {step.command()} failed; see {log}", file=sys.stderr)
    return status

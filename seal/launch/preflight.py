"""Preflight: the checks of a composed recipe, which turn the usual first-run failures (a bad value, no GPU, a
missing model or data file, an unreachable service, lengths that cannot fit, a disk too small for the checkpoints)
into clear messages before Ray and verl start.

The checks run by class (:func:`run_checks`), in this order: the values (``seal/config/checks.py``), the inputs
(:data:`INPUT_CHECKS`: model, data, disk, before anything is built from them or torch is imported), then, once
``prepare`` has built what the recipe builds, the node (:data:`NODE_CHECKS`) and the Ray cluster. The keys come
first, before the recipe is composed (``seal.launch.recipe.check_keys``). A run is refused at the first class with a
problem; ``--dry-run`` and :func:`preflight` collect them all.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from seal.launch.recipe import PreflightError, prepare


@dataclass
class Findings:
    """What the checks of a recipe found: problems by class (``keys``, ``values``, ``paths``, ``disk``,
    ``devices``, ``lengths``, ``batching``, ``checkpoints``, ``cluster``), warnings, and the checks that could not
    run because of a problem already found."""

    problems: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, kind: str, problems: list[str]) -> None:
        self.problems += [(kind, problem) for problem in problems]

    def run(self, kind: str, check, config) -> None:
        """One ``check(config, problems)``; when earlier problems are found (a value of the wrong type), a check
        that trips over them is skipped and named, not a traceback."""
        found: list[str] = []
        try:
            if "warnings" in inspect.signature(check).parameters:
                check(config, found, self.warnings)
            else:
                check(config, found)
        except Exception:
            if not self.problems:
                raise
            self.skipped.append(check.__name__.removeprefix("_check_").replace("_", " "))
        self.add(kind, found)

    def raise_if_any(self) -> None:
        if self.problems:
            lines = (f"[{kind}] {text}" for kind, text in self.problems)
            raise PreflightError("the recipe cannot run:\n  - " + "\n  - ".join(lines))


def run_checks(config: DictConfig, collect_all: bool = False, found: Findings | None = None) -> Findings:
    """The checks of a composed recipe, class by class: values (before anything is built or checked with them: the
    checks below would trip over a number given as text), inputs, then ``prepare`` (in place: the node's checks need
    what it builds), the node and the cluster. ``found`` holds what was found before (the keys), reported with these.

    A run (``collect_all`` false) is refused at the first class with a problem (``PreflightError``). ``collect_all``
    runs every class and returns all it found; with a wrong value, ``prepare`` and the classes after it are skipped
    (and named): they would be built from, or trip over, that value."""
    from seal.config.checks import value_problems

    found = Findings() if found is None else found
    end_of_class = (lambda: None) if collect_all else found.raise_if_any
    found.add("values", value_problems(config))
    values_ok = all(kind != "values" for kind, _ in found.problems)
    end_of_class()
    _run_each(found, INPUT_CHECKS, config)
    end_of_class()
    if not values_ok:  # only when collecting: a run has stopped at the values
        found.skipped.append("devices, lengths, batching, checkpoints, cluster (they need the values fixed first)")
        return found
    prepare(config)
    _run_each(found, NODE_CHECKS, config)
    end_of_class()
    found.run("cluster", _check_cluster, config)
    end_of_class()
    return found


def preflight(config: DictConfig) -> list[str]:
    """Every check of every class (:func:`run_checks`, collecting; ``config`` prepared in place): raise
    ``PreflightError`` listing every problem found; return warnings."""
    found = run_checks(config, collect_all=True)
    found.raise_if_any()
    return found.warnings


def _run_each(found: Findings, checks, config) -> None:
    for kind, check in checks:
        if check is _check_prompt_budget and not config.seal.preflight.prompt_budget:
            continue
        found.run(kind, check, config)


def _check_device(config, problems):
    from seal.launch.multinode import on_a_cluster

    if config.trainer.device != "cuda" or on_a_cluster(config):
        return  # on a cluster the nodes that hold the trainer's ranks are checked (_check_cluster), not this one
    from seal.launch.node_checks import cuda_problem, probe_cuda

    mismatch = cuda_problem(**probe_cuda())
    if mismatch:
        problems.append(mismatch)
    try:
        import torch

        available = torch.cuda.device_count()
    except Exception:
        available = 0
    wanted = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if available < int(config.trainer.n_gpus_per_node):
        problems.append(
            f"this recipe trains on {wanted} GPU(s) (trainer.n_gpus_per_node={config.trainer.n_gpus_per_node}) but "
            f"{available} CUDA device(s) are visible; on a CPU machine run exp/cpu_tiny.yaml"
        )


def _check_attention(config, problems):
    from seal.launch.node_checks import attention_implementation, attention_problem

    problem = attention_problem(attention_implementation(config.actor_rollout_ref.model))
    if problem:
        problems.append(problem)


def _check_padding_removal(config, problems):
    """Padding removal packs a micro-batch into one row; the attention must keep those sequences apart."""
    from seal.launch.node_checks import attention_implementation, separates_packed_sequences

    model = config.actor_rollout_ref.model
    implementation = attention_implementation(model)
    if not model.use_remove_padding or separates_packed_sequences(implementation):
        return
    packing = [name for name, several in _micro_batches(config) if several]
    if packing:
        problems.append(
            f"model.use_remove_padding with attn_implementation {implementation!r} would mix the sequences packed "
            f"into one micro-batch (this attention/transformers cannot tell them apart; each would attend to the ones "
            f"before it), and {', '.join(packing)} put several sequences in one: use flash_attention_2, or set "
            "actor_rollout_ref.model.use_remove_padding=false, or keep one sequence per micro-batch (micro batch "
            "size 1, no dynamic batch size)"
        )


def _micro_batches(config):
    """(setting, whether a micro-batch can hold several sequences) for each pass through the actor/ref model."""
    aro = config.actor_rollout_ref
    world = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)

    def per_gpu(section, key):
        value = section.get(f"{key}_per_gpu")
        if value is None and section.get(key) is not None:
            value = int(section.get(key)) // max(world, 1)
        return value

    sizes = {
        "actor.ppo_micro_batch_size_per_gpu": per_gpu(aro.actor, "ppo_micro_batch_size"),
        "ref.log_prob_micro_batch_size_per_gpu": per_gpu(aro.ref, "log_prob_micro_batch_size"),
        "rollout.log_prob_micro_batch_size_per_gpu": per_gpu(aro.rollout, "log_prob_micro_batch_size"),
    }
    dynamic = {
        "actor.use_dynamic_bsz": aro.actor.get("use_dynamic_bsz"),
        "ref.log_prob_use_dynamic_bsz": aro.ref.get("log_prob_use_dynamic_bsz"),
        "rollout.log_prob_use_dynamic_bsz": aro.rollout.get("log_prob_use_dynamic_bsz"),
    }
    return [(f"{k}={v}", v is not None and int(v) > 1) for k, v in sizes.items()] + [
        (f"{k}=true", bool(v)) for k, v in dynamic.items()
    ]


def _check_model(config, problems, warnings):
    model = str(config.actor_rollout_ref.model.path)
    if os.path.isdir(model):
        if not (Path(model) / "config.json").exists():
            problems.append(f"model.path {model!r} is a directory without config.json (not a Hugging Face model)")
        return
    if _built_by_prepare(config, model):
        return
    problem, warning = model_problem(model)
    problems += [f"model.path {problem}"] if problem else []
    warnings += [f"model.path {warning}"] if warning else []


def model_problem(model: str) -> tuple[str | None, str | None]:
    """(problem, warning) of a model given by path or hub id that is not a folder here: a path that does not
    exist; a hub id offline and not in the Hugging Face cache (nothing may download it: said now, not after the hub
    client's retries); or one that will be downloaded (a warning)."""
    if os.path.exists(model):
        return None, None
    if is_local_path(model):
        return f"{model!r} does not exist (from {os.getcwd()})", None
    from huggingface_hub import constants

    if _in_hub_cache(model):
        return None, None
    if constants.HF_HUB_OFFLINE:
        return (
            f"{model!r} is neither a local directory nor in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            "HF_HUB_OFFLINE=1: check the id's spelling or point it at a local checkpoint"
        ), None
    return None, f"{model!r} is a hub id not in the Hugging Face cache: it will be downloaded"


def is_local_path(model: str) -> bool:
    """Whether ``model`` names a folder on this machine rather than a hub id (``org/name``): it starts with ``.``,
    ``/`` or ``~``, has more than two parts, or its first part is a folder here (``checkpoints/best``, ``outputs/m``:
    two parts, like a hub id, but ``checkpoints/`` is this machine's)."""
    parts = model.strip("/").split("/")
    return model.startswith((".", "/", "~")) or len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def _built_by_prepare(config, model: str) -> bool:
    """The CPU recipes' tiny model: ``prepare`` builds it offline at ``seal.tiny_model.out_dir``, and its warm start
    (when the recipe has one) at ``seal.tiny_model.warm_start.out_dir``."""
    tiny = config.seal.get("tiny_model")
    if not (tiny and tiny.get("build")):
        return False
    warm = tiny.get("warm_start")
    built = [tiny.out_dir, *([warm.out_dir] if warm and warm.get("out_dir") else [])]
    return any(Path(model).resolve() == Path(str(path)).resolve() for path in built)


def _in_hub_cache(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except ValueError:  # not a valid hub id either
        return False


def _check_data(config, problems):
    """Every data file readable, with rows and a task id in each; evaluate-only tasks in none of them; and, when
    the run trains, no task both trained on and held out."""
    from seal.prompt_budget import DataFileError, task_rows

    task_ids: dict[str, list[str]] = {}
    for key in ("train_files", "val_files"):
        task_ids[key] = []
        for f in _as_list(config.data[key]):
            if not Path(f).exists():
                problems.append(
                    f"data.{key}: {f!r} not found from {os.getcwd()} (relative paths are taken from the current "
                    "directory: launch from the repository root, or regenerate with `python scripts/make_split.py`)"
                )
                continue
            try:
                ids = [row["task_id"] for row in task_rows(f, str(config.data.get("prompt_key") or "prompt"))]
            except DataFileError as exc:
                problems.append(f"data.{key}: {exc}")
                continue
            _refuse_ood_tasks(f"data.{key}", f, ids, problems)
            task_ids[key] += ids
    trainer = config.get("trainer") or {}
    if not trainer.get("val_only"):  # an evaluation trains nothing: any task may be validated
        validated = task_ids["val_files"] if _validates(trainer) else []  # a run that never validates: unused
        _refuse_contamination(task_ids["train_files"], validated, problems)


def _validates(trainer) -> bool:
    return bool(trainer.get("val_before_train")) or int(trainer.get("test_freq") or 0) > 0


def _refuse_ood_tasks(key: str, path: str, task_ids: list[str], problems: list[str]) -> None:
    """The out-of-distribution tasks (bfcl's memory / web-search categories) are evaluate-only: never in a run's data."""
    from env_service.bfcl.ood_tasks import is_ood_task

    ood = list(dict.fromkeys(task_id for task_id in task_ids if is_ood_task(task_id)))
    if ood:
        problems.append(
            f"{key}: {path!r} holds {_some(ood)} out-of-distribution task(s): bfcl's memory and web-search "
            "categories are evaluate-only, never trained or validated on; evaluate them with "
            "`python -m seal.eval endpoint --categories ...`"
        )


def _refuse_contamination(train: list[str], val: list[str], problems: list[str]) -> None:
    """A task trained on is never scored as held out: not one of the held-out split, not one of the validation files."""
    from env_service.bfcl.tasks import task_ids

    heldout = set(task_ids("heldout"))
    validated = set(val)
    in_heldout = [task_id for task_id in dict.fromkeys(train) if task_id in heldout]
    in_val = [task_id for task_id in dict.fromkeys(train) if task_id in validated and task_id not in heldout]
    if in_heldout:
        problems.append(
            f"data.train_files hold {_some(in_heldout)} task(s) of the held-out split (env_service.bfcl.tasks, the "
            "released 400/400 split): held-out tasks are for validation and evaluation only; remove them"
        )
    if in_val:
        problems.append(
            f"data.train_files and data.val_files share {_some(in_val)} task(s): validation would score tasks the "
            "policy trains on; keep the two files disjoint"
        )


def _some(ids: list[str], shown: int = 3) -> str:
    """``3 (a, b, c)`` or ``12 (a, b, c and 9 more)``: a count and the first few ids."""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{len(ids)} ({', '.join(ids[:shown])}{more})"


def _check_lengths(config, problems):
    rollout = config.actor_rollout_ref.rollout
    prompt, response = int(rollout.prompt_length), int(rollout.response_length)
    max_model_len = rollout.max_model_len
    if max_model_len is not None and prompt + response > int(max_model_len):
        problems.append(
            f"rollout.prompt_length ({prompt}) + response_length ({response}) exceeds max_model_len ({max_model_len})"
        )
    env_tokens = int(config.seal.rollout.max_env_tokens)
    if max_model_len is not None and env_tokens + response > int(max_model_len):
        problems.append(
            f"seal.rollout.max_env_tokens ({env_tokens}) + response_length ({response}) exceeds max_model_len "
            f"({max_model_len}): one environment message and one reply must fit in the context"
        )


def _check_prompt_budget(config, problems):
    """Every first prompt of the run (train rows in train mode, the others in validate mode) fits the budget."""
    from env_service.client import EnvServiceError
    from seal import prompt_budget

    files = [f for key in ("train_files", "val_files") for f in _as_list(config.data[key])]
    if not all(Path(f).exists() for f in files):
        return  # _check_data names the missing files
    budget = int(config.actor_rollout_ref.rollout.prompt_length)
    env_params = OmegaConf.to_container(config.env_service.bfcl, resolve=True)
    try:
        model = config.actor_rollout_ref.model
        longest = prompt_budget.longest(
            str(model.path), env_params, prompt_budget.run_episodes(files), model.get("custom_chat_template")
        )
    except EnvServiceError as exc:
        problems.append(f"the environment service cannot start an episode of the recipe's data: {exc.message}")
        return
    except prompt_budget.DataFileError:
        return  # _check_data names the file and what is wrong with it
    except ValueError as exc:  # env_service.bfcl refused by the environment's config validation
        problems.append(f"env_service.bfcl: {exc}")
        return
    for prompt in longest.values():
        if prompt.required > budget:
            problems.append(
                f"first prompts do not fit data.max_prompt_length ({budget}): {prompt.describe()}; raise "
                "data.max_prompt_length (and actor_rollout_ref.rollout.max_model_len by as much) or shorten the prompt"
            )


def _as_list(files):
    return list(files) if OmegaConf.is_list(files) or isinstance(files, (list, tuple)) else [str(files)]


def _check_batching(config, problems):
    n = int(config.actor_rollout_ref.rollout.n)
    batch = int(config.data.train_batch_size)
    workers = int(config.actor_rollout_ref.rollout.agent.num_workers)
    mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    if (batch * n) % workers:
        problems.append(
            f"data.train_batch_size x rollout.n = {batch * n} must be divisible by rollout.agent.num_workers ({workers})"
        )
    if batch % mini:
        problems.append(f"data.train_batch_size ({batch}) must be divisible by actor.ppo_mini_batch_size ({mini})")


def _check_estimator(config, problems, warnings):
    import difflib

    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    from seal.advantage import SEAL_GRPO

    estimator = str(config.algorithm.adv_estimator)
    known = sorted({e.value for e in AdvantageEstimator} | set(ADV_ESTIMATOR_REGISTRY))
    if estimator not in known:  # verl would say so only in its first training step, after the workers are up
        close = difflib.get_close_matches(estimator, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(known)}"
        problems.append(f"algorithm.adv_estimator {estimator!r} is not an estimator verl knows{hint}")
    if estimator in ("grpo", SEAL_GRPO) and int(config.actor_rollout_ref.rollout.n) < 2:
        problems.append("GRPO needs rollout.n >= 2 (advantages are relative within a group)")
    if estimator == "grpo":
        warnings.append(
            f"algorithm.adv_estimator=grpo is verl's GRPO as is: an episode that could not run enters its group as "
            f"reward 0 and shifts the others' advantages; {SEAL_GRPO} (the recipes' estimator) leaves it out"
        )


def _check_checkpoint_disk(config, problems):
    """The checkpoints the recipe keeps fit in the free space at ``trainer.default_local_dir``."""
    from seal.launch.memory_estimate import checkpoint_room
    from seal.units import disk_size

    room = checkpoint_room(config)
    if room is not None and not room.fits:
        problems.append(
            f"trainer.default_local_dir {str(room.root)!r}: the run keeps {room.disk.describe()} but "
            f"{disk_size(room.free_bytes)} is free there: free space or point trainer.default_local_dir at a larger "
            "disk (docs/gpu.md, disk)"
        )


def _check_service_limits(config, problems):
    """The services the launcher starts hold the trainer's peak episodes (``env_service.serve``: limits left null are
    raised to hold them; one set lower refuses the run's own requests once its episodes all call at once)."""
    if config.env_service.url:
        return  # a service you run: its limits are yours
    from env_service.bfcl.config import ServiceLimits
    from env_service.http.limits import HttpLimits
    from seal.launch.service import peak_episodes, serve_options

    options = serve_options(config)
    peak, planned = peak_episodes(config), int(options.pop("peak_episodes"))
    if planned < peak:
        problems.append(
            f"env_service.serve.peak_episodes is {planned}, below the {peak} episodes this recipe runs at once "
            "(train_batch_size x rollout.n, or the validation batch): leave it null (the recipe's) or raise it"
        )
    given = {k: v for k, v in options.items() if v is not None and k in HttpLimits.__dataclass_fields__}
    limits = HttpLimits.serving(planned, **given)
    problems += [f"env_service.serve.{line}" for line in limits.shortfalls(peak)]
    per_client = options.get("max_episodes_per_owner") or ServiceLimits().max_episodes_per_owner
    if per_client < peak:
        problems.append(
            f"env_service.serve.max_episodes_per_owner is {per_client}, below the {peak} episodes the trainer runs at "
            "once: set +env_service.serve.max_episodes_per_owner to at least that"
        )


def _check_checkpoints(config, problems):
    if config.seal.checkpoint.save_best and config.trainer.get("max_actor_ckpt_to_keep"):
        problems.append(
            "trainer.max_actor_ckpt_to_keep would rotate out the best checkpoint; with seal.checkpoint.save_best "
            "leave it null (seal.checkpoint.keep_only_best prunes the others at the end)"
        )


#: The checks of the recipe's inputs, right after its values: before anything is built from them or torch is
#: imported (a typo or a bad file is refused in a second or two).
INPUT_CHECKS = (("paths", _check_model), ("paths", _check_data), ("disk", _check_checkpoint_disk))
#: The checks of the recipe against this node, once ``prepare`` has built what the recipe builds.
NODE_CHECKS = (
    ("devices", _check_device),
    ("devices", _check_attention),
    ("devices", _check_padding_removal),
    ("lengths", _check_lengths),
    ("lengths", _check_prompt_budget),
    ("batching", _check_batching),
    ("batching", _check_estimator),
    ("checkpoints", _check_checkpoints),
    ("service", _check_service_limits),
)


def _check_cluster(config, problems):
    """A Ray cluster: each node must see this repository, venv and data, and one shared checkpoint filesystem, and
    those that hold a GPU trainer's ranks must run its CUDA."""
    from seal.launch.multinode import cluster_problems, on_a_cluster

    if on_a_cluster(config):
        problems += cluster_problems(config)

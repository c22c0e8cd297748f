"""Compose a recipe, check it, start (or connect to) the environment service, and train.

    python launcher.py --conf exp/SEAL.yaml [hydra overrides ...] [--dry-run [--full-config]]

A recipe is a Hydra config whose defaults are verl's ``ppo_trainer`` and ``seal_defaults``; the search path for
both and for the paper's recipes in ``exp/`` is supplied here, so a recipe kept anywhere can build on one
(``defaults: [SEAL, _self_]``). Every key of the recipe's files and of the overrides must exist
(``seal/config/keys.py``); then preflight turns the usual first-run failures (a bad value, no GPU, a missing model or
data file, an unreachable service, lengths that cannot fit, a disk too small for the checkpoints) into clear messages
before Ray and verl start. A run is refused at the first class of problem, in that order: keys, values, inputs
(before anything is built from them or torch is imported), the node. ``--dry-run`` runs every check, prints every
problem, then what the run would do and its memory and disk estimate. A run that stops for a cause one line can say
(a checkpoint that cannot be written) exits 1 with it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_LOOPS_YAML = Path(__file__).resolve().parents[1] / "config" / "agent_loops.yaml"
AGENT_LOOP_MANAGER = "seal.failed_episodes.SealAgentLoopManager"


class PreflightError(ValueError):
    """A configuration that cannot run, with what to change."""


class RunStopped(RuntimeError):
    """A run that stopped for a cause its one-line message names."""


def compose_recipe(conf: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    from hydra import compose, initialize_config_dir

    from seal.config.keys import searchpath

    path = Path(conf)
    if not path.is_file():
        raise PreflightError(f"recipe {conf!r} not found (recipes live in exp/, e.g. exp/SEAL.yaml)")
    try:
        with initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
            return compose(config_name=path.stem, overrides=[searchpath(), *overrides])
    except yaml.YAMLError as exc:  # the recipe or one it includes
        raise PreflightError(f"recipe {_yaml_problem(exc)}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "(position unknown)"
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    return f"{where}: not valid YAML: {problem}"


# ---- preflight ------------------------------------------------------------------------------------


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


def check_keys(conf: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every key of the recipe's files and of the overrides, against the schema (``seal/config/keys.py``): one line
    per unknown key with where it came from and the nearest key. Before anything is composed from them."""
    from seal.config.keys import recipe_key_problems

    if not Path(conf).is_file():
        raise PreflightError(f"recipe {conf!r} not found (recipes live in exp/, e.g. exp/SEAL.yaml)")
    try:
        return recipe_key_problems(conf, overrides)
    except yaml.YAMLError as exc:  # the recipe or one it includes
        raise PreflightError(f"recipe {_yaml_problem(exc)}") from None


def check_values(config: DictConfig) -> None:
    """Types of every key and the ``seal.*`` blocks (``seal/config/checks.py``): before anything is built or
    checked with them (the checks below would trip over a number given as text)."""
    from seal.config.checks import value_problems

    found = Findings()
    found.add("values", value_problems(config))
    found.raise_if_any()


def check_inputs(config: DictConfig) -> list[str]:
    """The recipe's model and data files and the disk for its checkpoints (:data:`INPUT_CHECKS`); returns warnings."""
    found = Findings()
    _run_checks(found, INPUT_CHECKS, config)
    found.raise_if_any()
    return found.warnings


def preflight(config: DictConfig) -> list[str]:
    """Raise ``PreflightError`` listing every problem found; return warnings."""
    check_values(config)
    found = Findings()
    _run_checks(found, INPUT_CHECKS + NODE_CHECKS, config)
    found.raise_if_any()
    return found.warnings


def _run_checks(found: Findings, checks, config) -> None:
    for kind, check in checks:
        if check is _check_prompt_budget and not config.seal.preflight.prompt_budget:
            continue
        found.run(kind, check, config)


def _check_device(config, problems):
    from seal.launch.multinode import on_a_cluster

    if config.trainer.device != "cuda" or on_a_cluster(config):
        return  # on a cluster the nodes that hold the trainer's ranks are checked (_check_nodes), not this one
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
    if int(config.seal.rollout.max_model_calls) < 1:
        problems.append("seal.rollout.max_model_calls must be >= 1")


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
    if config.algorithm.adv_estimator == "grpo" and n < 2:
        problems.append("GRPO needs rollout.n >= 2 (advantages are relative within a group)")


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
    from seal.launch.env_services import peak_episodes, serve_options

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
    ("checkpoints", _check_checkpoints),
    ("service", _check_service_limits),
)


# ---- environment service --------------------------------------------------------------------------


@contextlib.contextmanager
def environment_service(config: DictConfig):
    """The run's environment service; yields its URL and fills ``env_service.run_id``/``secret_file``/...

    ``env_service.url`` set: that service (it must answer /health); its secret, if any, comes from
    ``env_service.secret_file`` or ``$SEAL_ENV_SECRET``. Otherwise services started for this run only, with
    a fresh secret (a 0600 file in the run directory, never printed) and a fresh identity checked in
    /health: one on this machine's loopback, or one per Ray node when ``trainer.nnodes > 1``. Each is restarted
    when it dies and exits with its owner (``LocalService``); a run stopped for environment failures ends with
    ``RunStopped``, one line naming the service and its log (docs/faults.md).
    """
    from env_service.client import EnvClient
    from env_service.http.auth import resolve_secret
    from seal.launch import env_services

    env = config.env_service
    env.run_id = env.run_id or f"{config.trainer.experiment_name}-{env_services.new_service_id()}"
    if env.url:
        try:
            EnvClient(env.url, timeout_s=5, retries=1, secret=resolve_secret(secret_file=env.secret_file)).health()
        except Exception as exc:
            raise PreflightError(f"env_service.url {env.url!r} is not reachable: {exc}") from exc
        with _naming_the_service(lambda: f"the environment service at {env.url} (yours: its log is where you keep it)"):
            yield env.url
        return
    run_dir = Path(config.seal.run_dir).resolve()  # workers on any node read the secret file by this path
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = env_services.new_secret()
    env.secret_file = env_services.write_secret(run_dir / "env_service.secret", secret)
    env.service_id = env_services.new_service_id()
    try:
        from seal.launch.multinode import on_a_cluster

        starter = _node_services if on_a_cluster(config) else _local_service
        with starter(config, secret) as url:
            yield url
    except env_services.ServiceStartError as exc:
        raise PreflightError(str(exc)) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(env.secret_file)


@contextlib.contextmanager
def _local_service(config: DictConfig, secret: str):
    from env_service.http.auth import SECRET_ENV
    from seal.launch.env_services import LocalService, serve_flags, serve_options

    env = config.env_service
    log_path = Path(config.seal.run_dir) / "env_service.log"
    service = LocalService(
        env.secret_file,
        env.service_id,
        port=env.port,
        flags=serve_flags(serve_options(config)),
        log_path=log_path,
        host=str(env.host),
    ).start()
    print(f"[seal] environment service up at {service.url} (pid {service.proc.pid}, log {log_path})")
    service.supervise(
        report=lambda line: print(f"[seal] {line}", flush=True),
        on_give_up=lambda why: _interrupt_main(),  # the run stops wherever it waits; service.gave_up says why
        **_supervision(env.supervise),
    )
    # The clients of this process and of the local Ray cluster it starts (which inherits the environment)
    # default to $SEAL_ENV_SECRET; env_service.secret_file also names it, for processes started elsewhere.
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = secret
    try:
        with _naming_the_service(service.describe):
            yield service.url
    except KeyboardInterrupt:
        if service.gave_up:
            raise RunStopped(service.gave_up) from None
        raise
    finally:
        service.stop()
        if previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous


def _interrupt_main() -> None:
    """Stop the launcher's main thread as Ctrl-C would (a real SIGINT wakes it from any wait: a sleep, Ray's get),
    so the run leaves through its ``finally`` blocks."""
    import signal

    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@contextlib.contextmanager
def _node_services(config: DictConfig, secret: str):
    """One service per Ray node, each owned by an actor of this process's Ray connection, the run's driver: the
    launcher connects once, as verl's ``run_ppo`` would (``connect_ray``; run_ppo then uses that connection), so
    the actors end with the launcher however it ends (SIGKILL included: Ray ends a driver's actors with it, and
    each service exits with its actor). The launcher watches them; one whose restart budget is spent stops the run."""
    import ray

    from seal.launch.env_services import (
        node_services_given_up,
        serve_flags,
        serve_options,
        start_node_services,
        stop_node_services,
    )

    env = config.env_service
    connect_ray(config)
    try:
        here = ray.get_runtime_context().get_node_id()
        env.nodes = start_node_services(
            secret, env.service_id, serve_flags(serve_options(config)), _supervision(env.supervise)
        )
        print(f"[seal] {len(env.nodes)} environment services up, one per node: {dict(env.nodes)}")
        services = f"the environment services {dict(env.nodes)} (each logs to env_service.log in a seal-env-* folder)"
        gave_up: list[str] = []
        watching = threading.Event()

        def watch():  # a service past its restart budget: the run stops, naming it
            while not watching.wait(WATCH_S):
                gave_up.extend(node_services_given_up(env.service_id, list(env.nodes)))
                if gave_up:
                    _interrupt_main()
                    return

        threading.Thread(target=watch, name="env-services-watch", daemon=True).start()
        try:
            with _naming_the_service(lambda: services):
                yield env.nodes.get(here) or next(iter(env.nodes.values()))
        except KeyboardInterrupt:
            if gave_up:
                raise RunStopped(gave_up[0]) from None
            raise
        finally:
            watching.set()
            stop_node_services(env.service_id, list(env.nodes))
    finally:
        ray.shutdown()


#: How often the launcher asks its node services whether one has given up.
WATCH_S = 5.0


def _supervision(supervise) -> dict:
    """``env_service.supervise`` as ``LocalService.supervise`` takes it."""
    return {"max_restarts": int(supervise.max_restarts), "unresponsive_s": float(supervise.unresponsive_s)}


def connect_ray(config: DictConfig) -> None:
    """Connect this process to the run's Ray cluster (``ray_kwargs.ray_init.address``, else ``auto``) with the runtime
    env verl's ``run_ppo`` would give it (verl's defaults under the run's own), so that run_ppo, finding the process
    connected, uses this connection: what the launcher starts on the cluster belongs to the run's driver."""
    import ray

    set_run_environment(config)
    ray.init(
        address=config.ray_kwargs.ray_init.get("address") or "auto",  # a cluster started with `ray start`
        runtime_env=verl_runtime_env(config),
    )


def verl_runtime_env(config: DictConfig) -> dict:
    """The runtime env verl's ``run_ppo`` gives the run's Ray processes: verl's defaults under the run's own
    (``ray_kwargs.ray_init.runtime_env``, with ``set_run_environment``'s variables once it has run)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    return OmegaConf.to_container(merged, resolve=True)


@contextlib.contextmanager
def _naming_the_service(describe):
    """A run that stops for failed episodes (``TooManyFailedEpisodes``, raised in the trainer and delivered here
    wrapped in Ray's task error) says so in one line; when the environment failed them, naming the service
    (``describe()``) and its log (a generation or agent-loop failure has nothing to do with the service's log)."""
    try:
        yield
    except Exception as exc:
        from seal.failed_episodes import ENVIRONMENT, TooManyFailedEpisodes

        if not isinstance(exc, TooManyFailedEpisodes):
            raise
        cause = getattr(exc, "cause", None) or exc
        where = f"; {describe()}" if getattr(cause, "kind", ENVIRONMENT) == ENVIRONMENT else ""
        raise RunStopped(f"{cause}{where}") from None


def _check_nodes(config: DictConfig) -> None:
    """A Ray cluster: each node must see this repository, venv and data, and one shared checkpoint filesystem, and
    those that hold a GPU trainer's ranks must run its CUDA."""
    problems = _node_problems(config)
    if problems:
        raise PreflightError("the Ray nodes cannot run this recipe:\n  - " + "\n  - ".join(problems))


def _check_cluster(config, problems):
    problems += _node_problems(config)


def _node_problems(config: DictConfig) -> list[str]:
    from seal.launch.multinode import cluster_problems, on_a_cluster

    return cluster_problems(config) if on_a_cluster(config) else []


# ---- run ------------------------------------------------------------------------------------------


def prepare(config: DictConfig) -> DictConfig:
    """Materialise what the recipe needs: the offline tiny model (CPU recipes, optionally warm-started) and the
    agent-loop registration."""
    tiny = config.seal.get("tiny_model")
    if tiny and tiny.get("build"):
        from seal.cpu.tiny_model import build_tiny_model

        build_tiny_model(tiny.out_dir, seed=int(tiny.seed), shape=tiny.get("shape", "default"))
        warm = tiny.get("warm_start")
        if warm and warm.get("out_dir"):  # supervised steps on ground-truth episodes (seal/cpu/warm_start.py), cached
            from seal.cpu.warm_start import warm_start

            bfcl = OmegaConf.to_container(config.env_service.bfcl, resolve=True)
            decoys = OmegaConf.to_container(warm.get("decoys") or {}, resolve=True)
            warm_start(
                tiny.out_dir,
                warm.out_dir,
                list(warm.tasks),
                bfcl,
                int(warm.steps),
                float(warm.lr),
                int(tiny.seed),
                decoys,
            )
    agent = config.actor_rollout_ref.rollout.agent
    if not agent.agent_loop_config_path:
        # verl's AgentLoopWorker reads this list and registers `seal_bfcl` in every agent-loop process.
        agent.agent_loop_config_path = str(AGENT_LOOPS_YAML)
    if not agent.get("agent_loop_manager_class"):
        with open_dict(agent):  # verl's field, absent from its YAML: a step where every episode failed still runs
            agent.agent_loop_manager_class = AGENT_LOOP_MANAGER
    from seal.launch.multinode import absolute_paths

    absolute_paths(config)  # workers on other nodes get this config, not this working directory
    return config


def run_environment(config: DictConfig) -> dict[str, str]:
    """Environment variables of every process of the run: CPU platform (CPU recipes) and logger locations."""
    from seal.cpu.platform import cpu_runtime_env
    from seal.cpu.vllm_cpu import runtime_env as vllm_cpu_env

    env = {**cpu_runtime_env(), **vllm_cpu_env()} if config.trainer.device == "cpu" else {}
    # verl warns at every import about optional engines (megatron, torchtitan, ...) that seal does not use
    env["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS", "ignore::UserWarning:verl.workers.engine")
    return {**env, **logger_locations(Path(config.seal.run_dir).resolve())}


#: The run folder whose logger locations this process's environment holds, set with them.
LOGGERS_OF_RUN = "SEAL_LOGGERS_OF_RUN"


def logger_locations(run_dir: Path) -> dict[str, str]:
    """Where verl's file and tensorboard loggers write (by default relative to the cwd): in the run folder.

    A location already in the environment wins when the user set it, or when this run set it (calling again keeps
    the metrics file's name). One set for another run (a second run in the same process, or a process started
    after one) is not the user's: this run derives its own rather than log into that run's folder."""
    derived = {
        "TENSORBOARD_DIR": str(run_dir / "tensorboard"),
        "VERL_FILE_LOGGER_PATH": str(run_dir / f"metrics_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"),
    }
    if os.environ.get(LOGGERS_OF_RUN, str(run_dir)) == str(run_dir):
        derived = {key: os.environ.get(key, value) for key, value in derived.items()}
    return {**derived, LOGGERS_OF_RUN: str(run_dir)}


def ray_runtime_env(config: DictConfig, env_vars: dict[str, str]):
    """The Ray runtime env of the run: our variables, under what the recipe's ``ray_kwargs.ray_init.runtime_env``
    sets itself (e.g. ``env_vars.OMP_NUM_THREADS`` for a shared CPU machine wins over our core count)."""
    return OmegaConf.merge({"env_vars": env_vars}, config.ray_kwargs.ray_init.get("runtime_env") or {})


def set_run_environment(config: DictConfig) -> None:
    """The run's environment variables (``run_environment``) in this process and in the run's Ray runtime env.

    Set before verl is imported here (the platform is chosen at import). A local Ray cluster this process starts
    inherits them; a cluster started elsewhere (`ray start`) gets them through the runtime env. Calling it again
    changes nothing (the variables it derives keep the values already set)."""
    env_vars = run_environment(config)
    Path(config.seal.run_dir).mkdir(parents=True, exist_ok=True)  # verl's file logger writes there
    os.environ.update(env_vars)
    OmegaConf.set_struct(config, False)
    config.ray_kwargs.ray_init.runtime_env = ray_runtime_env(config, env_vars)


def train(config: DictConfig) -> None:
    set_run_environment(config)
    import ray
    from verl.trainer.main_ppo import run_ppo

    from seal.trainer import CheckpointSaveError, make_task_runner

    connected = ray.is_initialized()  # by the node services' owner (connect_ray), which disconnects itself
    try:
        run_ppo(config, task_runner_class=make_task_runner())
    except CheckpointSaveError as exc:  # raised in Ray's task runner: Ray's error is an instance of it too
        raise RunStopped(str(getattr(exc, "cause", exc))) from None
    finally:
        if not connected and ray.is_initialized():
            ray.shutdown()


def exit_on_termination(run):
    """SIGTERM and SIGHUP (a scheduler's cancel, a closed terminal) leave ``run`` through its ``finally`` blocks, as
    Ctrl-C does: the service is stopped and the run's secret file removed (Python's default ends at once). A SIGKILL
    cannot be caught: then the service sees its launcher gone and does both itself (``serve --parent-pid``)."""
    import functools
    import signal

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    @functools.wraps(run)
    def guarded(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
            return run(*args, **kwargs)
        previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return run(*args, **kwargs)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    return guarded


@exit_on_termination
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", required=True, help="recipe YAML, e.g. exp/SEAL.yaml")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check and print every problem found, then what the run would do and its memory and disk "
        "estimate; do not train (exit 2 when a problem was found)",
    )
    parser.add_argument("--full-config", action="store_true", help="with --dry-run: also print the composed config")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_epochs=1")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            return dry_run(args.conf, args.overrides, full_config=args.full_config)
        config = checked_config(args.conf, args.overrides)
        with environment_service(config) as url:
            OmegaConf.set_struct(config, False)
            config.env_service.url = url
            train(config)
    except PreflightError as exc:
        print(f"[seal] error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"[seal] error: {exc}", file=sys.stderr)
        return 1
    except (HydraException, OmegaConfBaseException) as exc:  # a bad override or key: say which, not a traceback
        print(f"[seal] error: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


def checked_config(conf: str, overrides: list[str]) -> DictConfig:
    """The recipe composed and checked, class by class, refused at the first class with a problem: keys (before
    anything is composed), values (before anything is built from them), inputs (model, data, disk: before torch is
    imported), then ``prepare`` and the checks against this node and the cluster. Nothing has started yet."""
    found = Findings()
    found.add("keys", check_keys(conf, overrides))
    found.raise_if_any()
    config = compose_recipe(conf, overrides)
    check_values(config)  # before prepare() builds anything from the values
    warnings = check_inputs(config)
    config = prepare(config)
    found = Findings()
    _run_checks(found, NODE_CHECKS, config)
    found.raise_if_any()
    for warning in warnings + found.warnings:
        print(f"[seal] warning: {warning}")
    _check_nodes(config)
    return config


def dry_run(conf: str, overrides: list[str], full_config: bool = False) -> int:
    """Every check of every class, all problems printed together (stderr), then what the run would do and its memory
    and disk estimate, whatever was found (stdout); 2 when a problem was found. An override that names an unknown
    key is reported and left out, so that the recipe still composes and the other checks run."""
    from seal.config.checks import value_problems
    from seal.config.keys import bad_overrides
    from seal.launch.summary import summary

    found = Findings()
    found.add("keys", check_keys(conf, overrides))
    refused = set(bad_overrides(overrides))
    config = compose_recipe(conf, [o for o in overrides if o not in refused])
    found.add("values", value_problems(config))
    values_ok = not found.problems or all(kind == "keys" for kind, _ in found.problems)
    _run_checks(found, INPUT_CHECKS, config)
    shown = config.copy()  # the recipe's own paths, before prepare() makes them absolute
    if values_ok:  # what prepare() builds from them, and the checks that need it
        config = prepare(config)
        _run_checks(found, NODE_CHECKS, config)
        found.run("cluster", _check_cluster, config)
    else:
        found.skipped.append("devices, lengths, batching, checkpoints, cluster (they need the values fixed first)")
    for kind, text in found.problems:
        print(f"[seal] error: [{kind}] {text}", file=sys.stderr)
    for warning in found.warnings:
        print(f"[seal] warning: {warning}", file=sys.stderr)
    for skipped in found.skipped:
        print(f"[seal] not checked: {skipped}", file=sys.stderr)
    for line in summary(conf, shown, problems=bool(found.problems)):
        print(f"[seal] {line}")
    if full_config:
        print(OmegaConf.to_yaml(config, resolve=not found.problems))
    if found.problems:
        print(f"[seal] {len(found.problems)} problem(s): the run would be refused", file=sys.stderr)
        return 2
    return 0

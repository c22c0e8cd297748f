"""A checkpoint or hub id through training's own validation.

The recipe is composed as for training, with ``trainer.val_only`` and ``trainer.val_before_train``, greedy
``val_kwargs``, the model path, and the selected tasks as ``data.val_files``, and handed to ``seal.launch``
(compose → preflight → environment service → trainer). The run does nothing but its step-0 validation, through
the same rollout backend, agent loop, episode limits and environment settings as the training run's validation,
so a checkpoint scores what its training validation scored. The agent loop appends one record per episode to the
results file (``seal.eval.results_path``).
"""

from __future__ import annotations

import glob
import os
import threading

from seal.eval.tasks import write_eval_dataset
from seal.results.records import load_records

GPU_RECIPE = "exp/SEAL.yaml"
CPU_RECIPE = "exp/cpu_tiny.yaml"


def default_recipe() -> str:
    try:
        import torch

        return GPU_RECIPE if torch.cuda.is_available() else CPU_RECIPE
    except ImportError:
        return CPU_RECIPE


def resolve_model(model: str) -> str:
    """A training checkpoint folder (``trainer.default_local_dir``: its latest checkpoint, the run's last step when
    the run saved it) or one checkpoint (``global_step_N``, the ``best`` link) means that checkpoint's Hugging Face
    model (``huggingface/``, written for the best checkpoint, or ``actor/huggingface/`` when verl saved the weights
    there); a checkpoint with neither but with its FSDP shards is exported first (``seal.validation.export_hf``).
    Anything else is taken as is."""
    latest = os.path.join(model, "latest_checkpointed_iteration.txt")
    if os.path.isfile(latest):
        with open(latest) as f:
            model = os.path.join(model, f"global_step_{f.read().strip()}")
    if not os.path.isdir(model) or os.path.exists(os.path.join(model, "config.json")):
        return model
    for sub in ("huggingface", os.path.join("actor", "huggingface")):
        if _has_weights(os.path.join(model, sub)):
            return os.path.join(model, sub)
    if glob.glob(os.path.join(model, "actor", "model_world_size_*_rank_*.pt")):
        from seal.validation import export_hf

        return export_hf(model)
    return model


def _has_weights(folder: str) -> bool:
    """A Hugging Face model folder with its weights (verl writes ``config.json`` into ``actor/huggingface`` even
    when it saves no weights there)."""
    weights = ("*.safetensors", "*.bin", "*.safetensors.index.json")
    return os.path.isfile(os.path.join(folder, "config.json")) and any(
        glob.glob(os.path.join(folder, pattern)) for pattern in weights
    )


def eval_overrides(
    model: str | None, val_file: str, results_path: str, out_dir: str, max_model_calls: int | None = None
) -> list[str]:
    """Hydra overrides that turn a training recipe into a greedy, validation-only run over ``val_file``."""
    out_dir = os.path.abspath(out_dir)
    overrides = [
        "trainer.val_only=true",
        "trainer.val_before_train=true",
        f"data.val_files={os.path.abspath(val_file)}",
        "data.val_batch_size=null",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "trainer.experiment_name=seal_eval",
        f"seal.run_dir={out_dir}/run",
        f"trainer.default_local_dir={out_dir}/run/checkpoints",
        "trainer.logger=[console,file]",
        "seal.checkpoint.save_best=false",
        f"++seal.eval.results_path={os.path.abspath(results_path)}",
    ]
    if model:
        overrides += [f"actor_rollout_ref.model.path={resolve_model(model)}", "seal.tiny_model.build=false"]
    if max_model_calls is not None:
        overrides.append(f"seal.rollout.max_model_calls={int(max_model_calls)}")
    return overrides


#: The keys that hold an episode's first prompt (the rollout's prompt length follows the first).
PROMPT_KEYS = ("data.max_prompt_length", "actor_rollout_ref.rollout.max_model_len")
PROMPT_ROUNDING = 256


def prompt_fit_overrides(recipe: str, overrides: list[str]) -> list[str]:
    """Raise the recipe's prompt budget to the longest first prompt of the tasks evaluated, keeping the room it
    leaves after the prompt (the CPU recipe's 4,096 tokens fit its training tasks, not most held-out prompts).
    Nothing when they fit, or when the overrides set the budget themselves (then preflight names the keys)."""
    from omegaconf import OmegaConf

    from seal import prompt_budget
    from seal.launch.preflight import _as_list
    from seal.launch.recipe import compose_recipe

    if any(o.lstrip("+").split("=", 1)[0] in PROMPT_KEYS for o in overrides):
        return []
    try:
        config = compose_recipe(recipe, overrides)
        budget = int(config.data.max_prompt_length)
    except Exception:  # noqa: BLE001 - a recipe or override that cannot run: the launcher says why, in one line
        return []
    model = config.actor_rollout_ref.model
    episodes = prompt_budget.run_episodes(_as_list(config.data.val_files))
    bfcl = OmegaConf.to_container(config.env_service.bfcl, resolve=True)
    longest = prompt_budget.longest(str(model.path), bfcl, episodes, model.get("custom_chat_template"))
    needed = max((p.required for p in longest.values()), default=0)
    if needed <= budget:
        return []
    raised = -(-needed // PROMPT_ROUNDING) * PROMPT_ROUNDING
    after_prompt = int(config.actor_rollout_ref.rollout.max_model_len) - budget
    print(
        f"[seal.eval] the evaluated tasks' first prompts need up to {needed} tokens, more than the recipe's "
        f"data.max_prompt_length ({budget}): evaluating with data.max_prompt_length={raised} and "
        f"actor_rollout_ref.rollout.max_model_len={raised + after_prompt}"
    )
    return [f"data.max_prompt_length={raised}", f"actor_rollout_ref.rollout.max_model_len={raised + after_prompt}"]


def run_checkpoint(
    task_ids: list[str],
    results_path: str,
    out_dir: str,
    *,
    recipe: str | None = None,
    model: str | None = None,
    max_model_calls: int | None = None,
    extra_overrides: list[str] = (),
    progress: bool = True,
) -> int:
    """Validate ``task_ids`` (the caller leaves out finished ones); returns the launcher's exit status."""
    from seal.launch.cli import main

    val_file = write_eval_dataset(task_ids, os.path.join(out_dir, "eval_tasks.parquet"))
    os.makedirs(os.path.join(out_dir, "run"), exist_ok=True)  # verl's file logger does not create its folder
    overrides = eval_overrides(model, val_file, results_path, out_dir, max_model_calls) + list(extra_overrides)
    overrides += prompt_fit_overrides(recipe or default_recipe(), overrides)
    stop = threading.Event()
    watcher = threading.Thread(target=_progress, args=(results_path, len(task_ids), stop, progress), daemon=True)
    watcher.start()
    try:
        return main(["--conf", recipe or default_recipe(), *overrides])
    finally:
        stop.set()
        watcher.join(timeout=5)


def _progress(results_path: str, total: int, stop: threading.Event, enabled: bool) -> None:
    """A progress bar fed by the records the agent loop appends (verl's validation has none of its own)."""
    from tqdm import tqdm

    start = len(load_records(results_path))
    with tqdm(total=total, desc="eval (checkpoint)", unit="task", disable=not enabled) as bar:
        while not stop.wait(2.0):
            bar.n = min(total, len(load_records(results_path)) - start)
            bar.refresh()
        bar.n = min(total, len(load_records(results_path)) - start)
        bar.refresh()

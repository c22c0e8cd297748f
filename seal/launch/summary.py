"""What ``launcher.py --dry-run`` prints after the problems it found: what the run would do, its memory per GPU and
its disk, in a few tens of lines (``--full-config`` adds the composed config). Each part is printed whatever the
checks found; a part that cannot be worked out from the recipe as it stands says so instead."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from omegaconf import DictConfig


def summary(conf: str, config: DictConfig, problems: bool) -> list[str]:
    lines = []
    for part in (_run, _data, _switches, _env_service, _writes, _memory, _disk):
        lines += _guarded(part, config, problems)
    return [f"recipe {conf}", *lines, "the whole composed config: add --full-config"]


def _guarded(part: Callable[[DictConfig], Iterable[str]], config: DictConfig, problems: bool) -> list[str]:
    try:
        return list(part(config))
    except Exception as exc:  # a value of the wrong type, already reported
        if not problems:
            raise
        name = part.__name__.strip("_")
        return [f"{name}: not worked out ({type(exc).__name__}: fix the problems above)"]


def _run(config):
    from seal.launch.memory_estimate import training_steps

    trainer = config.trainer
    where = f"{trainer.nnodes} node(s) x {trainer.n_gpus_per_node} {'GPU' if trainer.device == 'cuda' else 'CPU slot'}"
    yield f"model {config.actor_rollout_ref.model.path} on {where}(s)"
    if trainer.get("val_only"):
        yield "evaluation only (trainer.val_only): one validation, no training step"
        return
    rollout = config.actor_rollout_ref.rollout
    per_step = f"{config.data.train_batch_size} task(s) x {rollout.n} rollouts a step"
    fixed = trainer.get("total_training_steps")
    steps = training_steps(config)
    how = "trainer.total_training_steps" if fixed else f"{trainer.total_epochs} epoch(s) of the train file"
    validations = [
        *(["before training"] if trainer.val_before_train else []),
        *([f"every {trainer.test_freq} step(s) and after the last"] if int(trainer.test_freq or 0) > 0 else []),
    ]
    yield f"{steps} step(s) ({how}), {per_step}; validation {', '.join(validations) or 'never'}"


def _data(config):
    from seal.launch.memory_estimate import data_rows

    for key in ("train_files", "val_files"):
        files = config.data[key]
        names = [str(files)] if isinstance(files, str) else [str(f) for f in files]
        yield f"data.{key}: {', '.join(names)} ({data_rows(names)} rows)"


def _switches(config):
    seal, bfcl = config.seal, config.env_service.bfcl
    apatch = "on" + (" (closed loop)" if seal.apatch.dynamic.enable else " (static weights)")

    def on(flag) -> str:
        return "on" if flag else "off"

    yield (
        f"SEAL: diagnosis {on(seal.diagnosis.enable)}, A-Patch {apatch if seal.apatch.enable else 'off'}, "
        f"schema cues {on(bfcl.observation_lite.enable)}, recovery feedback {on(bfcl.tool_feedback_evolution.enable)}, "
        f"capability cues {on(bfcl.capability_cues.enable)}, reward {seal.reward.mode}"
    )


def _env_service(config):
    """The service the launcher would start here: its workers, their memory and why (sized on each node it runs on)."""
    if config.env_service.url:
        yield f"environment service: yours at {config.env_service.url} (none started)"
        return
    from seal.launch.multinode import on_a_cluster
    from seal.launch.service import serve_options, service_workers

    where = "on each node (sized there; this node's)" if on_a_cluster(config) else "on this node"
    yield f"environment service {where}: {service_workers(serve_options(config)).describe()}"


def _writes(config):
    trainer, best = config.trainer, config.seal.checkpoint
    saves = f"every {trainer.save_freq} step(s) and the last" if int(trainer.save_freq or 0) > 0 else "no periodic save"
    kept = ", the best by " + str(best.best_metric) if best.save_best else ""
    yield f"run folder {config.seal.run_dir} (logger: {', '.join(trainer.logger)})"
    yield f"checkpoints {trainer.default_local_dir} ({saves}{kept})"


def _memory(config):
    if config.trainer.device != "cuda":
        yield "memory per GPU: not estimated (a CPU run)"
        return
    from seal.launch.memory_estimate import estimate

    found = estimate(config)
    if found is None:
        yield (
            f"memory per GPU: not estimated ({config.actor_rollout_ref.model.path!r} has no local config.json and is "
            "not in seal/launch/memory_estimate.py's known-size table)"
        )
        return
    yield from found.lines()
    yield from (f"warning: {warning}" for warning in found.warnings())


def _disk(config):
    from seal.launch.memory_estimate import checkpoint_disk, checkpoint_room
    from seal.units import disk_size

    room = checkpoint_room(config)
    if room is None:
        nothing = checkpoint_disk(config) is not None
        yield "disk: no checkpoint written" if nothing else "disk: not estimated (the model's size is unknown)"
        return
    there = f" ({disk_size(room.present_bytes)} already there)" if room.present_bytes else ""
    verdict = "fits" if room.fits else "does NOT fit"
    yield (f"disk at peak: {room.disk.describe()}; {disk_size(room.free_bytes)} free at {room.root}{there}: {verdict}")

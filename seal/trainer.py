"""The SEAL trainer: verl's ``RayPPOTrainer`` with the SEAL step added in one place.

One training step (verl's ``fit`` drives it; this class adds the SEAL parts):

    1. rollout   — verl's agent loop runs ``seal_bfcl`` episodes against the environment service
                   (``seal/agent_loop.py``): 0/1 verdict as reward, per-turn diagnosis in ``seal_*`` fields;
    2. verify    — the service's official BFCL verdict is the reward (``rm_scores`` from the agent loop);
    3. advantage — verl's GRPO, computed by verl in ``fit`` with the estimator registered as
                   ``algorithm.adv_estimator: seal_grpo``: episodes that could not run (any failure kind) are taken out
                   of their group's statistics (``seal/advantage.py``);
    4. diagnose  — ``_seal_step``: the batch's tags feed the capability state (closed loop: dynamic tag weights);
    5. A-Patch   — ``_seal_step``: each trajectory's advantage is scaled by clip(mean tag weight) (``seal/apatch.py``);
    6. update    — verl's actor update (FSDP2 engine), unchanged.

Steps 4–5 run in ``_update_actor``: verl calls it right after the GRPO advantages are computed and before the
policy update, so overriding it (and nothing of ``fit``) places them exactly where the paper does.
Around the step: its training metrics on disk before its validation (``_write_step_metrics``), validation
metrics over the episodes the environment could run (``_val_metrics_update``),
best-checkpoint selection by the four-category average, capability state in checkpoints,
per-epoch diagnostic dumps, the failure profile pushed to the environment service, HF export at the end.
A resume (``_load_checkpoint``) continues as the uninterrupted run would have (docs/resume.md): capability state,
the epoch's data order, metric files cut back to the step, the failure profile sent before the first rollout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import time
import uuid

import numpy as np
from omegaconf import OmegaConf
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.metric import reduce_metrics

from env_service.files import atomic_write_json
from seal.apatch import APatchConfig, apply_apatch, vocabulary_field
from seal.capability_state import CapabilityState
from seal.config.checks import rule_problem
from seal.diagnostics import DiagnosticStats
from seal.env_clients import env_client, profile_client
from seal.failed_episodes import FAILURE_KINDS, failure_shares, split_validation_failures
from seal.results.figures import run_figures
from seal.resume import resume_data_order, train_sampler, truncate_metric_files
from seal.units import disk_size
from seal.validation import BestCheckpoint, category_average, validation_table

logger = logging.getLogger(__name__)

STATE_FILE = "seal_capability_state.json"
#: The training metrics of each step as soon as its update is done (a ``metrics_*.jsonl``: the run readers take it).
STEP_METRICS_FILE = "metrics_steps.jsonl"


class SealTrainer(RayPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_seal()

    @classmethod
    def seal_parts_only(cls, config, steps_per_epoch: int) -> SealTrainer:
        """A trainer with its SEAL parts and no Ray workers behind it (tests, and the CPU rehearsal of a step's
        trainer side in ``scripts/production_shape.py``): ``_seal_step`` and the validation metrics run, nothing
        that needs a model does."""
        trainer = cls.__new__(cls)
        trainer.config, trainer.train_dataloader, trainer.global_steps = config, [None] * steps_per_epoch, 1
        trainer._init_seal()
        return trainer

    def _init_seal(self) -> None:
        seal = self.config.seal
        self.diagnosis_enabled = bool(seal.diagnosis.enable)
        self.apatch_cfg = APatchConfig.from_dict(OmegaConf.to_container(seal.apatch, resolve=True))
        # A new run never inherits another run's capability state; a resumed run restores it from its
        # checkpoint (``_load_checkpoint``), so the state always matches the weights it trained.
        state_path = os.path.join(seal.diagnosis.state_dir, STATE_FILE)
        self.state = CapabilityState.open(state_path, run_id=self.config.trainer.experiment_name, resume=False)
        self.stats = DiagnosticStats(self.state, vocabulary=self.apatch_cfg.vocabulary)
        self.best = BestCheckpoint(self.config)
        self.run_uid = uuid.uuid4().hex  # a resumed run takes its own back from the checkpoint
        self.best.bind_run(self.run_uid)
        self.resumed_step: int | None = None  # the checkpoint's step, when this launch resumed one
        self.epoch_in_window: int | None = None
        debug = seal.get("debug", {})
        self.advantage_sign = int(debug.get("advantage_sign", 1))
        if problem := rule_problem("debug.advantage_sign", self.advantage_sign):
            raise ValueError(problem)

    # ---- the SEAL step ---------------------------------------------------------------------------

    def _update_actor(self, batch):
        # a step the environment failed has stopped the run already, as its rollout returned (SealAgentLoopManager)
        start = time.perf_counter()
        seal_metrics = self._seal_step(batch)
        seal_metrics["timing_s/seal_step"] = time.perf_counter() - start  # verl times the update around it
        output = super()._update_actor(batch)
        output.meta_info["metrics"].update(seal_metrics)
        self._write_step_metrics(output.meta_info["metrics"])
        return output

    def _write_step_metrics(self, metrics: dict) -> None:
        """The step's training metrics, on disk before the step's validation: verl logs a step only after its
        validation, so a validation that dies (an out-of-memory at the last step) would take them along.
        A file of its own (verl's file logger truncates and owns its file); ``read_metrics`` merges both."""
        if "file" not in self.config.trainer.logger:
            return
        data = {}
        for key, value in reduce_metrics(metrics).items():
            with contextlib.suppress(TypeError, ValueError):  # a metric that is not a number is verl's logger's
                data[key] = float(value)
        line = {"step": self.global_steps, "data": data}
        with open(os.path.join(self._run_dir(), STEP_METRICS_FILE), "a") as f:
            f.write(json.dumps(line) + "\n")

    def _seal_step(self, batch) -> dict:
        """Diagnose → update the capability state → A-Patch, on the batch verl is about to train on."""
        trajectories = batch_trajectories(batch)
        metrics = rollout_metrics(trajectories)
        for kind, error in sorted({(t["failure_kind"], t["error"]) for t in trajectories if t["failed"]}):
            logger.warning("step %d: episodes failed (kind %s): %s", self.global_steps, kind, error)
        if self.diagnosis_enabled:
            epoch = self._epoch_of(self.global_steps)
            self._start_epoch_window(epoch)
            self.stats.observe_batch(trajectories, epoch=epoch, global_step=self.global_steps)
            metrics.update(self.stats.metrics())
        if self.apatch_cfg.enable:
            drive = vocabulary_field(self.apatch_cfg.vocabulary)
            advantages, apatch_metrics = apply_apatch(
                batch.batch["advantages"],
                [None if t["failed"] else t[drive] for t in trajectories],
                self.apatch_cfg,
                global_step=self.global_steps,
                state=self.state if self.diagnosis_enabled else None,
            )
            batch.batch["advantages"] = advantages
            metrics.update(apatch_metrics)
        if self.advantage_sign == -1:  # only the learning check's sign-flipped twin: it must fail to learn
            batch.batch["advantages"] = -batch.batch["advantages"]
        if self.diagnosis_enabled and self.config.env_service.bfcl.capability_cues.enable:
            self._push_failure_profile()
        return metrics

    def _epoch_of(self, step: int) -> int:
        return (max(step, 1) - 1) // max(len(self.train_dataloader), 1)

    def _start_epoch_window(self, epoch: int) -> None:
        """At an epoch change: dump the finished epoch's window, reset it, persist the state (the released order)."""
        if self.epoch_in_window is not None and epoch != self.epoch_in_window:
            self._finalize_epoch(self.epoch_in_window)
        self.epoch_in_window = epoch

    def _finalize_epoch(self, epoch: int) -> None:
        # at the epoch's last trained step (the figures draw the dump there), not at the step that noticed the end
        step = self.global_steps if self.stats.last_step is None else self.stats.last_step
        path = self.stats.finalize_epoch(self.config.seal.diagnosis.dump_dir, epoch, step)
        print(f"[seal] epoch {epoch} diagnostics: {path}; capability state: {self.state.path}")

    def _push_failure_profile(self) -> None:
        """Capability cues: the next rollouts' train-only guidelines follow this step's failure profile."""
        env = self.config.env_service
        profile = self.state.failure_profile(per_category=bool(env.bfcl.capability_cues.per_category))
        try:  # to every node's service when the launcher runs one per node, else through the cached client
            nodes = env.get("nodes")
            client = (
                profile_client(env, env.get("run_id"), timeout_s=float(env.timeout_s), retries=int(env.retries))
                if nodes
                else env_client(env)
            )
            client.set_profile(profile)
        except Exception as exc:  # cues are an interface aid: a failed push must not stop training
            logger.warning("could not push the failure profile to the environment service: %s", exc)

    # ---- validation and checkpoints ---------------------------------------------------------------

    def _validate(self, merged: bool = False):
        metrics = super()._validate(merged=merged)
        if merged:
            return metrics
        metrics.update(category_average(metrics))
        table = validation_table(metrics, step=self.global_steps)
        print(table)
        with open(os.path.join(self._run_dir(), "validation_table.txt"), "w") as f:  # the latest, per category
            f.write(table + "\n")
        # a resume validates its checkpoint again: reported, but the uninterrupted run never ran it, so it picks no best
        metrics.update(self.best.observe(self, metrics, revalidation=self.global_steps == self.resumed_step))
        return metrics

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns):
        """verl's per-data-source metrics over the episodes the environment could run; failures reported apart."""
        kept, failures = split_validation_failures(
            data_sources,
            sample_uids,
            reward_extra_infos_dict,
            sample_turns,
            failure_shares(self.config.seal.validation),
        )
        return {**super()._val_metrics_update(*kept), **failures}

    def _run_dir(self) -> str:
        """``seal.run_dir``: where the tables and plots of the run live (created on first use)."""
        os.makedirs(self.config.seal.run_dir, exist_ok=True)
        return self.config.seal.run_dir

    def _checkpoint_state_path(self) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}", STATE_FILE)

    def _save_checkpoint(self):
        with explained_save_failure(os.path.dirname(self._checkpoint_state_path())):
            super()._save_checkpoint()
            atomic_write_json(
                self._checkpoint_state_path(),
                {
                    "state": self.state.state_dict(),
                    "epoch_in_window": self.epoch_in_window,
                    "run_uid": self.run_uid,
                    "diagnostics_window": self.stats.window_state(),
                },
            )
        self.best.prune()

    def _load_checkpoint(self):
        result = super()._load_checkpoint()
        if self.global_steps > 0:  # resumed: continue as the uninterrupted run would have
            self.resumed_step = self.global_steps
            self._restore_capability_state()
            resume_data_order(self.train_dataloader, self.global_steps)
            for path in truncate_metric_files(self._run_dir(), self.global_steps):
                print(f"[seal] resumed at step {self.global_steps}: dropped the later steps from {path}")
            if self.diagnosis_enabled and self.config.env_service.bfcl.capability_cues.enable:
                self._push_failure_profile()  # the service is new: the first resumed rollout gets the run's cues
        return result

    def _restore_capability_state(self) -> None:
        """The capability state, diagnostics window and run identity continue exactly where the run stopped."""
        path = self._checkpoint_state_path()
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        self.state.load_state_dict(saved["state"])
        self.epoch_in_window = saved["epoch_in_window"]
        if "diagnostics_window" in saved:  # checkpoints written before it was saved have only the state
            self.stats.load_window_state(saved["diagnostics_window"])
        self.run_uid = saved.get("run_uid", self.run_uid)
        self.best.bind_run(self.run_uid)
        print(f"[seal] restored capability state from {path}")

    def fit(self):
        super().fit()
        if self.diagnosis_enabled and self.epoch_in_window is not None:
            self._finalize_epoch(self.epoch_in_window)
        self.best.finish()
        # drawn from what the run logged: accuracy per category with SE bands, tag shares, A-Patch weights and scales
        for plot in run_figures(self._run_dir(), apatch_prefix=self.apatch_cfg.metric_prefix):
            print(f"[seal] figure: {plot}")


# ---- a checkpoint that cannot be written ---------------------------------------------------------


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed; the message is one line naming the checkpoint's path and the cause."""


#: Bytes written to find the cause of a failed save (verl's workers report a full disk as torch's
#: ``basic_ios::clear: iostream error``, without the errno).
PROBE_BYTES = 1024**2


@contextlib.contextmanager
def explained_save_failure(step_dir: str):
    """Turn a failed save of ``step_dir`` into a ``CheckpointSaveError`` naming it and the cause (ENOSPC, EFBIG,
    ...). The partial checkpoint goes (it is not the latest and holds the space the next attempt needs); the
    previous checkpoints stay: pruning runs only after a save succeeded."""
    existed = os.path.exists(step_dir)
    try:
        yield
    except Exception as exc:
        cause = save_failure_cause(exc, os.path.dirname(step_dir))
        if not existed and not _is_latest(step_dir):
            shutil.rmtree(step_dir, ignore_errors=True)
        raise CheckpointSaveError(f"cannot save checkpoint {step_dir}: {cause}; earlier checkpoints are kept") from exc


def save_failure_cause(exc: BaseException, directory: str) -> str:
    """The errno of the failure where the exception carries one, else the errno of a probe write to
    ``directory`` (a full disk is still full), else the innermost message's first line."""
    errors = list(_causes(exc))
    for error in errors:
        if isinstance(error, OSError) and error.errno:
            return _describe_errno(error.errno, directory)
    probe_errno = _probe_write(directory)
    if probe_errno:
        return _describe_errno(probe_errno, directory)
    return (str(errors[-1]).strip().splitlines() or [type(errors[-1]).__name__])[0]


def _causes(exc: BaseException):
    """The exception, what it was raised from, and the original of a Ray task error (``cause``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__


def _probe_write(directory: str) -> int | None:
    if not os.path.isdir(directory):
        return None
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return error.errno
    return None


def _describe_errno(number: int, directory: str) -> str:
    cause = f"{os.strerror(number)} ({errno.errorcode.get(number, number)})"
    with contextlib.suppress(OSError):
        cause += f", {disk_size(shutil.disk_usage(directory).free)} free there"
    return cause


def _is_latest(step_dir: str) -> bool:
    """Whether verl's tracker already names ``step_dir`` the resume point."""
    tracker = os.path.join(os.path.dirname(step_dir), "latest_checkpointed_iteration.txt")
    with contextlib.suppress(OSError):
        with open(tracker) as f:
            return os.path.basename(step_dir) == f"global_step_{f.read().strip()}"
    return False


# ---- batch views ---------------------------------------------------------------------------------


def batch_trajectories(batch) -> list[dict]:
    """Per-row dicts of what the agent loop attached: the inputs of diagnosis and A-Patch."""
    nt = batch.non_tensor_batch
    rewards = batch.batch["token_level_scores"].sum(-1).tolist()
    rows = []
    for i, reward in enumerate(rewards):
        failed = bool(nt["seal_failed"][i])
        rows.append(
            {
                "task_id": nt["seal_task_id"][i],
                "category": nt["seal_category"][i],
                "reward": float(reward),
                "tags": list(nt["seal_tags"][i]),
                "labels": list(nt["seal_labels"][i]),
                "env_texts": list(nt["seal_env_errors"][i]),
                "failed": failed,
                "failure_kind": str(nt["seal_failure_kind"][i]),
                "termination": nt["seal_termination"][i],
                "model_calls": int(nt["seal_model_calls"][i]),
                "response_truncated": bool(nt["seal_response_truncated"][i]),
                "error": str(nt["seal_error"][i]),
            }
        )
    return rows


def rollout_metrics(trajectories: list[dict]) -> dict:
    n = max(len(trajectories), 1)
    metrics = {
        "seal/rollout/failed_episodes": sum(t["failed"] for t in trajectories),
        "seal/rollout/model_calls_mean": float(np.mean([t["model_calls"] for t in trajectories]))
        if trajectories
        else 0.0,
        "seal/rollout/reward_mean": float(np.mean([t["reward"] for t in trajectories])) if trajectories else 0.0,
        # episodes longer than rollout.response_length: their tail is cut from the loss (raise it if this grows)
        "seal/rollout/response_truncated": sum(t["response_truncated"] for t in trajectories) / n,
    }
    for kind in FAILURE_KINDS:  # every kind, zeros too: a curve that appears only when it fails is easy to miss
        metrics[f"seal/failed_episodes/{kind}"] = sum(t["failure_kind"] == kind for t in trajectories)
    for reason in sorted({t["termination"] for t in trajectories}):
        metrics[f"seal/rollout/termination/{reason}"] = sum(t["termination"] == reason for t in trajectories) / n
    return metrics


# ---- the task runner (verl's documented hook for recipes: subclass BaseTaskRunner) -----------------


def make_task_runner():
    import ray
    from verl.trainer.main_ppo_v0 import BaseTaskRunner

    class SealTaskRunner(BaseTaskRunner):
        """Builds verl's workers and datasets exactly like verl's TaskRunner, with ``SealTrainer`` as the trainer."""

        def run(self, config):
            from verl.trainer.ppo.utils import create_rl_dataset, need_critic, need_reference_policy
            from verl.utils.config import omega_conf_to_dataclass, validate_config
            from verl.utils.dataset.rl_dataset import collate_fn
            from verl.workers.config import HFModelConfig

            OmegaConf.resolve(config)
            actor_rollout_cls, ray_worker_group_cls = self.add_actor_rollout_worker(config)
            self.add_critic_worker(config)
            self.add_reward_model_resource_pool(config)
            self.add_teacher_model_resource_pool(config)
            self.add_ref_policy_worker(config, actor_rollout_cls)
            validate_config(
                config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
            )
            model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
            tokenizer, processor = model_config.tokenizer, model_config.processor
            train_dataset = create_rl_dataset(
                config.data.train_files,
                config.data,
                tokenizer,
                processor,
                is_train=True,
                max_samples=config.data.get("train_max_samples", -1),
            )
            val_dataset = create_rl_dataset(
                config.data.val_files,
                config.data,
                tokenizer,
                processor,
                is_train=False,
                max_samples=config.data.get("val_max_samples", -1),
            )
            trainer = SealTrainer(
                config=config,
                tokenizer=tokenizer,
                processor=processor,
                role_worker_mapping=self.role_worker_mapping,
                resource_pool_manager=self.init_resource_pool_mgr(config),
                ray_worker_group_cls=ray_worker_group_cls,
                train_dataset=train_dataset,
                val_dataset=val_dataset,
                collate_fn=collate_fn,
                train_sampler=train_sampler(config.data, train_dataset),  # each epoch's order from (seed, epoch)
            )
            trainer.init_workers()
            trainer.fit()

    return ray.remote(num_cpus=1)(SealTaskRunner)

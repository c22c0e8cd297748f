"""A resumed run is the run that would have been: what verl does not carry across a restart, made a function of
the step instead.

- **Data order.** verl's shuffling sampler draws each epoch's order from one generator that runs on across
  epochs; at an epoch boundary verl does not restore the dataloader, so a resumed run walked epoch 0's order
  again. ``EpochShuffleSampler`` draws epoch ``e``'s order from ``(data.seed, e)`` alone and keeps its epoch and
  position in the dataloader's checkpointed state; the trainer names the epoch after a resume at a boundary.
- **Rollout randomness.** The rollout servers seed their sampling once at start, so the first step after a
  restart drew the random numbers the run's first step drew. ``seed_samples`` gives every training sample a seed
  from ``(rollout.seed, global step, position in the batch)``; the agent loop derives each model call's seed
  from it (``call_seed``), and a retried episode's from its attempt (``attempt_seed``: a retry draws afresh,
  and the same in a rerun).
- **Metric files.** Steps after the checkpoint were logged by the killed run and are logged again by the resumed
  one; ``truncate_metric_files`` cuts every ``metrics_*.jsonl`` of the run back to the resumed step.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
from torch.utils.data import Sampler

#: The non-tensor field of a training batch that carries each sample's seed to the agent loop.
SEED_FIELD = "seal_seed"
#: Mixed into a retry's seed: its parts never equal a model call's ``(sample seed, call index)``.
RETRY_STREAM = 1


def derive_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from non-negative integers (the same parts give the same seed on any machine)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


# ---- data order ------------------------------------------------------------------------------------


class EpochShuffleSampler(Sampler[int]):
    """Shuffles each epoch with a permutation drawn from ``(seed, epoch)`` alone.

    An epoch counts as walked when its last index has been handed out: the dataloader may make iterators it never
    uses (torch's multi-worker iterator makes two per epoch), and those change nothing. torchdata's
    ``StatefulDataLoader`` saves ``state_dict`` (the epoch being walked and how far) in verl's checkpoint and, on a
    mid-epoch resume, restores it before it iterates again; ``set_epoch`` is for a resume at an epoch boundary,
    where verl restores nothing.
    """

    def __init__(self, data_source, seed: int):
        self.size = len(data_source)
        self.seed = int(seed)
        self.epoch = 0  # the epoch the next walk takes
        self.start = 0  # and where in it (a restored position)
        self.position = [0, 0]  # [epoch, indices handed out] of the current walk

    def __len__(self) -> int:
        return self.size

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        return torch.randperm(self.size, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start = int(epoch), 0

    def __iter__(self):
        return self._walk()

    def _walk(self):
        # a generator: nothing below runs before the dataloader asks for the first index
        epoch, start = self.epoch, self.start
        self.position = [epoch, start]
        for index in self.order(epoch)[start:]:
            self.position[1] += 1  # counted before it is handed out: a saved state never replays an index
            yield index
        self.epoch, self.start = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.position[0], "yielded": self.position[1]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = int(state["epoch"]), int(state["yielded"])


def train_sampler(data_config, dataset):
    """The training sampler: ``EpochShuffleSampler`` for a shuffled run with a ``data.seed``, else verl's own
    (in order; or an unseeded shuffle, which no restart could reproduce anyway)."""
    if data_config.shuffle and data_config.get("seed") is not None:
        return EpochShuffleSampler(dataset, int(data_config.seed))
    from verl.trainer.ppo.utils import create_rl_sampler

    return create_rl_sampler(data_config, dataset)


def resume_data_order(dataloader, global_steps: int) -> None:
    """After a resume at ``global_steps``: the next iteration walks the epoch that step belongs to.

    At an epoch boundary verl restores no dataloader state, so this names the next epoch; mid-epoch, verl's
    restore (which happens when the dataloader next iterates) sets the same epoch and the position in it."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, EpochShuffleSampler) and len(dataloader):
        sampler.set_epoch(global_steps // len(dataloader))


# ---- rollout randomness ------------------------------------------------------------------------------


def seed_samples(batch, base_seed: int) -> None:
    """Give each sample of a training batch its seed, from ``(base_seed, global step, position)``."""
    step = max(int(batch.meta_info.get("global_steps", 0)), 0)
    batch.non_tensor_batch[SEED_FIELD] = np.array(
        [derive_seed(base_seed, step, i) for i in range(len(batch))], dtype=np.int64
    )


def attempt_seed(sample_seed, attempt: int) -> int | None:
    """The seed of a sample's ``attempt``-th try (0: the first, which keeps the sample's seed). A retry after an
    environment failure draws other tokens than the attempt that failed, and the same ones in a rerun."""
    if sample_seed is None or attempt == 0:
        return sample_seed
    return derive_seed(int(sample_seed), attempt, RETRY_STREAM)


def call_seed(sample_seed, call_index: int) -> int | None:
    """The seed of one model call of a seeded sample (``None``: the sample is not seeded, e.g. validation)."""
    return None if sample_seed is None else derive_seed(int(sample_seed), call_index)


# ---- metric files ------------------------------------------------------------------------------------


def truncate_metric_files(run_dir: str, step: int) -> list[str]:
    """Drop every line after ``step`` from the run's ``metrics_*.jsonl`` (a torn last line too); returns the
    files it rewrote. Each rewrite is atomic; a file with nothing to drop is left alone (verl's logger of the
    resumed run has its own file open, still empty)."""
    rewritten = []
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics_*.jsonl"))):
        with open(path) as f:
            lines = f.readlines()
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) == len(lines):
            continue
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
        os.replace(tmp, path)
        rewritten.append(path)
    return rewritten


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None

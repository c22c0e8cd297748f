"""What a resume restores that verl does not: the data order across an epoch boundary, per-step sample seeds,
metric files with each step once.

The data order goes through torchdata's ``StatefulDataLoader`` built as verl builds it (``drop_last``, the
trainer's sampler) and through verl's resume rule: the dataloader state is restored mid-epoch and skipped at an
epoch boundary (``RayPPOTrainer._load_checkpoint``).
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader
from verl import DataProto

from seal.resume import SEED_FIELD, call_seed, resume_data_order, seed_samples, train_sampler, truncate_metric_files

TASKS = list(range(5))


def loader(num_workers: int = 0, batch_size: int = 1) -> StatefulDataLoader:
    data = OmegaConf.create({"shuffle": True, "seed": 1})
    return StatefulDataLoader(
        dataset=TASKS,
        batch_size=batch_size,
        num_workers=num_workers,
        drop_last=True,
        collate_fn=lambda batch: batch,
        sampler=train_sampler(data, TASKS),
    )


def epochs(dataloader, count: int) -> list[list[int]]:
    return [[i for batch in dataloader for i in batch] for _ in range(count)]


def resumed(global_steps: int, saved_state: dict, num_workers: int = 0) -> StatefulDataLoader:
    """A fresh dataloader after verl's and then seal's resume steps."""
    dataloader = loader(num_workers)
    if global_steps % len(dataloader):  # verl restores the state only mid-epoch
        dataloader.load_state_dict(saved_state)
    resume_data_order(dataloader, global_steps)
    return dataloader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_epoch_is_shuffled_by_its_number(num_workers):
    """Epoch e walks the order of (seed, e) whichever way the dataloader makes its iterators."""
    dataloader = loader(num_workers)
    orders = epochs(dataloader, 3)
    assert orders == [dataloader.sampler.order(epoch) for epoch in range(3)]
    assert all(sorted(order) == TASKS for order in orders) and len({tuple(order) for order in orders}) > 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_at_an_epoch_boundary_walks_the_next_epochs_order(num_workers):
    uninterrupted = epochs(loader(num_workers), 3)
    killed = loader(num_workers)
    epochs(killed, 1)  # the run is killed right after the checkpoint at the end of epoch 0
    state = killed.state_dict()
    assert epochs(resumed(len(TASKS), state, num_workers), 2) == uninterrupted[1:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mid_epoch_resume_continues_the_epoch_and_the_next(num_workers):
    uninterrupted = epochs(loader(num_workers), 2)
    killed = loader(num_workers)
    walked = []
    for batch in killed:
        walked += batch
        if len(walked) == 2:
            state = killed.state_dict()  # the checkpoint after step 2
            break
    dataloader = resumed(2, state, num_workers)
    rest = [i for batch in dataloader for i in batch]
    assert walked + rest == uninterrupted[0]
    assert epochs(dataloader, 1) == uninterrupted[1:]


def test_unseeded_or_ordered_runs_keep_verls_sampler():
    from torch.utils.data import SequentialSampler

    assert isinstance(train_sampler(OmegaConf.create({"shuffle": False, "seed": 1}), TASKS), SequentialSampler)
    assert type(train_sampler(OmegaConf.create({"shuffle": True, "seed": None}), TASKS)).__name__ == "RandomSampler"


def seeds(step: int, rows: int = 4) -> list[int]:
    batch = DataProto.from_single_dict({"x": torch.zeros(rows)}, meta_info={"global_steps": step})
    seed_samples(batch, 42)
    return batch.non_tensor_batch[SEED_FIELD].tolist()


def test_sample_seeds_follow_the_step_and_the_sample():
    assert seeds(3) == seeds(3)  # a resumed step 3 draws what the uninterrupted step 3 drew
    assert len(set(seeds(1) + seeds(3))) == 8  # not step 1's draws, and every sample its own
    calls = [call_seed(seeds(3)[0], n) for n in range(4)]
    assert len(set(calls)) == 4 and call_seed(None, 0) is None


def write_metrics(path, steps, torn: bool = False):
    lines = [json.dumps({"step": s, "data": {"x": float(s)}}) for s in steps]
    path.write_text("".join(line + "\n" for line in lines) + ('{"step": 5, "da' if torn else ""))


def test_a_resume_truncates_the_metric_files_to_its_step(tmp_path):
    write_metrics(tmp_path / "metrics_steps.jsonl", [1, 2, 3])
    write_metrics(tmp_path / "metrics_20260101-000000.jsonl", [0, 1, 2, 3, 4], torn=True)
    write_metrics(tmp_path / "metrics_20260101-010000.jsonl", [])  # the resumed launch's own, still empty
    rewritten = truncate_metric_files(str(tmp_path), 2)
    assert sorted(rewritten) == sorted(
        str(tmp_path / n) for n in ("metrics_steps.jsonl", "metrics_20260101-000000.jsonl")
    )
    for name, steps in (("metrics_steps.jsonl", [1, 2]), ("metrics_20260101-000000.jsonl", [0, 1, 2])):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == steps
    assert truncate_metric_files(str(tmp_path), 2) == []

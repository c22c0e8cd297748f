"""Tasks, the 400/400 split and the committed verl datasets (data/)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from env_service.bfcl.tasks import (
    CATEGORIES,
    Task,
    all_task_ids,
    load_task,
    parse_task_id,
    split_indices,
    split_of,
    task_ids,
)
from tests.support.processes import repo_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"

# The released split procedure, quoted verbatim.
BASE_TRAIN_PREFIX = [0, 2, 3, 5, 10, 12, 13, 14, 15, 16, 18, 19, 27]
BASE_VAL = [
    4,
    9,
    21,
    29,
    34,
    48,
    77,
    81,
    82,
    98,
    99,
    120,
    124,
    127,
    131,
    132,
    134,
    138,
    149,
    164,
    169,
    174,
    178,
    183,
    198,
]
PYTHON_HINT = "Note that the provided function is in Python 3 syntax"


# -- tasks ----------------------------------------------------------------------------------------


def test_800_tasks_200_per_category():
    ids = all_task_ids()
    assert len(ids) == len(set(ids)) == 800
    for category in CATEGORIES:
        cat_ids = all_task_ids(category)
        assert cat_ids == [f"multi_turn_{category}_{i}" for i in range(200)]
        assert all(load_task(i).category == category for i in cat_ids[:3])


def test_task_fields():
    task = load_task("multi_turn_base_0")
    assert isinstance(task, Task)
    assert (task.id, task.category, task.index, task.long_context) == ("multi_turn_base_0", "base", 0, False)
    assert task.data_source == "multi_turn_base"
    assert len(task.question) == len(task.ground_truth) == task.num_turns
    assert task.involved_classes and set(task.initial_config) <= set(task.involved_classes) | {"MathAPI"}
    assert task.holdout_functions == {}
    assert load_task("multi_turn_long_context_3").long_context is True


def test_function_docs_are_raw_without_python_hint():
    for task_id in all_task_ids():
        task = load_task(task_id)
        docs = task.functions + [d for docs in task.holdout_functions.values() for d in docs]
        assert docs and all(PYTHON_HINT not in doc["description"] for doc in docs)
        assert all({"name", "description", "parameters"} <= set(doc) for doc in docs)


def test_miss_func_holdouts_are_removed_from_visible_functions():
    for task_id in all_task_ids("miss_func"):
        task = load_task(task_id)
        assert len(task.holdout_functions) == 1
        ((turn, docs),) = task.holdout_functions.items()
        visible = {doc["name"] for doc in task.functions}
        assert docs and not visible & {doc["name"] for doc in docs}
        assert task.question[turn] == []  # the holdout turn has no user text
        assert task.ground_truth[turn - 1] == []  # the turn before it must be abstained
    for category in ("base", "miss_param", "long_context"):
        assert all(load_task(i).holdout_functions == {} for i in all_task_ids(category)[:20])
    task = load_task("multi_turn_miss_func_49")  # the known unsolvable one (tail held out until turn 3)
    assert [d["name"] for d in task.holdout_functions[3]] == ["wc", "tail", "cat"]
    assert "tail(file_name='file3.txt')" in task.ground_truth[1]


def test_load_task_returns_independent_copies():
    first = load_task("multi_turn_miss_func_0")
    first.functions[0]["description"] += " MUTATED"
    first.functions.append({"name": "x"})
    first.question[0][0]["content"] = "changed"
    first.initial_config.clear()
    first.ground_truth[0].append("ls()")
    next(iter(first.holdout_functions.values())).clear()
    second = load_task("multi_turn_miss_func_0")
    assert "MUTATED" not in second.functions[0]["description"]
    assert second.functions[-1]["name"] != "x"
    assert second.question[0][0]["content"] != "changed"
    assert second.initial_config and second.ground_truth[0][-1] != "ls()"
    assert all(next(iter(second.holdout_functions.values())))
    with pytest.raises(AttributeError):
        second.id = "other"  # frozen


@pytest.mark.parametrize("bad", ["multi_turn_base_200", "multi_turn_unknown_1", "base_1", "", "multi_turn_base_x"])
def test_unknown_task_ids(bad):
    with pytest.raises(KeyError, match="unknown task id"):
        load_task(bad)


def test_parse_task_id():
    assert parse_task_id("multi_turn_miss_param_17") == ("miss_param", 17)
    assert parse_task_id("multi_turn_long_context_199") == ("long_context", 199)
    for bad in ("multi_turn_base", "multi_turn_foo_1", "xx_base_1", "multi_turn_base_-1"):
        with pytest.raises(ValueError):
            parse_task_id(bad)
    with pytest.raises(ValueError, match="unknown category"):
        all_task_ids("simple")


# -- split ----------------------------------------------------------------------------------------


def test_split_indices_follow_spec_rule():
    split = split_indices()
    order = list(range(200))
    saved = random.getstate()
    try:
        random.seed(42)  # the released procedure: equivalently random.seed(42); random.shuffle(l)
        random.shuffle(order)
    finally:
        random.setstate(saved)
    assert split == {"train": sorted(order[:100]), "val": sorted(order[100:125]), "test": sorted(order[125:])}
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == (100, 25, 75)
    assert sorted(split["train"] + split["val"] + split["test"]) == list(range(200))
    assert split["train"][: len(BASE_TRAIN_PREFIX)] == BASE_TRAIN_PREFIX
    assert split["val"] == BASE_VAL
    assert split_indices(seed=0) != split


def test_task_ids_per_split_order():
    split = split_indices()
    train = task_ids("train")
    assert len(train) == 400 and train[:13] == [f"multi_turn_base_{i}" for i in BASE_TRAIN_PREFIX]
    assert train == [f"multi_turn_{c}_{i}" for c in CATEGORIES for i in split["train"]]
    val, test = task_ids("val"), task_ids("test")
    assert (len(val), len(test)) == (100, 300)
    assert val[:25] == [f"multi_turn_base_{i}" for i in BASE_VAL]
    assert task_ids("heldout") == val + test
    assert task_ids("all") == all_task_ids()
    assert not set(train) & set(task_ids("heldout"))
    assert split_of("multi_turn_miss_func_4") == "val" and split_of("multi_turn_base_0") == "train"
    with pytest.raises(ValueError, match="unknown split"):
        task_ids("dev")


# -- committed data files -------------------------------------------------------------------------


def test_committed_files_reproduce_byte_for_byte(tmp_path):
    make_split = repo_script("scripts/make_split.py")
    make_split.generate(tmp_path)
    for name in make_split.OUTPUT_FILES:
        assert (DATA / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert make_split.check(DATA) == []
    (tmp_path / make_split.TRAIN_FILE).write_bytes(b"corrupt")
    assert make_split.main(["--check", "--out-dir", str(tmp_path)]) == 1


def test_split_json_contents():
    doc = json.loads((DATA / "split.json").read_text())
    assert doc["seed"] == 42 and doc["categories"] == list(CATEGORIES)
    assert doc["indices"] == split_indices()
    for name in ("train", "val", "test", "heldout"):
        assert doc["task_ids"][name] == task_ids(name)


@pytest.mark.parametrize(
    "file_name, split_name", [("bfcl_train.parquet", "train"), ("bfcl_heldout.parquet", "heldout")]
)
def test_parquet_schema_and_rows(file_name, split_name):
    table = pq.read_table(DATA / file_name)
    assert table.schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]
    assert table.schema.metadata is None or b"pandas" not in table.schema.metadata
    rows = table.to_pylist()
    expected_ids = task_ids(split_name)
    assert [row["extra_info"]["task_id"] for row in rows] == expected_ids
    for row in rows:
        task = load_task(row["extra_info"]["task_id"])
        assert row["data_source"] == f"multi_turn_{task.category}"
        assert row["prompt"] == [{"role": "user", "content": task.id}]
        assert row["ability"] == "multi_turn_function_calling"
        assert row["reward_model"]["style"] == "interaction"
        assert json.loads(row["reward_model"]["ground_truth"]) == task.ground_truth
        assert row["extra_info"] == {
            "task_id": task.id,
            "index": task.id,
            "split": split_of(task.id),
            "category": task.category,
        }
        assert row["agent_name"] == "seal_bfcl"
    splits = [row["extra_info"]["split"] for row in rows]
    if split_name == "train":
        assert set(splits) == {"train"}
    else:
        assert splits == ["val"] * 100 + ["test"] * 300


def test_bfcl_writes_only_under_the_scratch_root():
    import os

    from bfcl_eval.constants import eval_config

    from env_service.bfcl import upstream  # noqa: F401

    assert eval_config.PROJECT_ROOT == Path(os.environ["BFCL_PROJECT_ROOT"])
    assert "site-packages" not in str(eval_config.PROJECT_ROOT)


def test_concurrent_first_loads_build_the_task_table_once():
    """A fresh service hit by many creates at once must parse the 800 tasks once, not once per request."""
    from concurrent.futures import ThreadPoolExecutor

    from env_service.bfcl import tasks

    tasks._build_all_tasks.cache_clear()
    with ThreadPoolExecutor(max_workers=8) as pool:
        loaded = list(pool.map(tasks.load_task, tasks.task_ids("train")[:16]))
    assert len(loaded) == 16
    assert tasks._build_all_tasks.cache_info().misses == 1

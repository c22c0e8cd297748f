#!/usr/bin/env python
"""Write the SEAL data split (docs/method.md: 400 train / 400 held-out, 100 + 100 per category) and the verl RL datasets.

Outputs (under ``--out-dir``, default ``data/``):

* ``split.json``: seed, rule, per-split indices and task ids (train / val / test / heldout).
* ``bfcl_train.parquet``: the 400 train tasks, category-major then index.
* ``bfcl_heldout.parquet``: the 400 held-out tasks, all val rows (category-major) then all test rows
  (the released split's order).
* ``cpu_tiny_train.parquet`` / ``cpu_tiny_heldout.parquet``: the embedded CPU recipe's tasks (see below).
* ``gpu_smoke_heldout.parquet``: the GPU smoke recipe's validation tasks (see below).
* ``cpu_learning_train.parquet``: the CPU learning check's train tasks (see below).

Parquet columns (verl RLHFDataset layout): ``data_source`` (``multi_turn_<category>``, the
validation metric key), ``prompt`` (``[{"role": "user", "content": <task id>}]``: a placeholder, the
real prompt comes from the environment service at rollout), ``ability``, ``reward_model``
(``{ground_truth: JSON of the GT turns, style: "interaction"}``), ``extra_info`` (``task_id``,
``index`` = task id, ``split``, ``category`` = short category name), ``agent_name`` (``seal_bfcl``).

Files are written with pyarrow directly (explicit schema, no pandas metadata), so regenerating
reproduces them byte-for-byte with the same pyarrow version (its version string is embedded in the
parquet footer). ``--check`` regenerates into a temporary directory and compares bytes.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from env_service.bfcl import upstream
from env_service.bfcl.tasks import (
    CATEGORIES,
    SPLIT_RULE,
    SPLIT_SEED,
    load_task,
    split_indices,
    split_of,
    task_ids,
)

ROOT = Path(__file__).resolve().parents[1]
SPLIT_FILE = "split.json"
TRAIN_FILE = "bfcl_train.parquet"
HELDOUT_FILE = "bfcl_heldout.parquet"
# The embedded CPU recipe (exp/cpu_tiny.yaml) trains on the 2 train tasks with the shortest tool schemas and
# validates on the shortest held-out task of each category: the smallest prompts keep a 2-core run short.
TINY_TRAIN_FILE = "cpu_tiny_train.parquet"
TINY_HELDOUT_FILE = "cpu_tiny_heldout.parquet"
# exp/gpu_smoke.yaml validates on the 2 held-out tasks of each category with the shortest tool schemas: a node
# check that still covers every category in a minute of validation.
GPU_SMOKE_HELDOUT_FILE = "gpu_smoke_heldout.parquet"
# exp/cpu_learning.yaml trains on the train task of 2 turns with one call each that has the shortest prompt (one
# of the two tasks of the tiny model's small tokenizer, seal/cpu/tiny_model.py BPE_TOKENIZERS): short enough for
# a tiny model to learn on CPU, in steps as cheap as a BFCL episode allows.
LEARNING_TRAIN_FILE = "cpu_learning_train.parquet"
LEARNING_TRAIN_IDS = ["multi_turn_base_100"]
OUTPUT_FILES = (
    SPLIT_FILE,
    TRAIN_FILE,
    HELDOUT_FILE,
    TINY_TRAIN_FILE,
    TINY_HELDOUT_FILE,
    GPU_SMOKE_HELDOUT_FILE,
    LEARNING_TRAIN_FILE,
)

ABILITY = "multi_turn_function_calling"
AGENT_NAME = "seal_bfcl"
REWARD_STYLE = "interaction"

SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field(
            "prompt",
            pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])),
        ),
        pa.field("ability", pa.string()),
        pa.field(
            "reward_model",
            pa.struct([pa.field("ground_truth", pa.string()), pa.field("style", pa.string())]),
        ),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    pa.field("task_id", pa.string()),
                    pa.field("index", pa.string()),
                    pa.field("split", pa.string()),
                    pa.field("category", pa.string()),
                ]
            ),
        ),
        pa.field("agent_name", pa.string()),
    ]
)


def dataset_row(task_id: str, seed: int = SPLIT_SEED) -> dict:
    task = load_task(task_id)
    return {
        "data_source": task.data_source,
        "prompt": [{"role": "user", "content": task.id}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": json.dumps(task.ground_truth), "style": REWARD_STYLE},
        "extra_info": {
            "task_id": task.id,
            "index": task.id,
            "split": split_of(task.id, seed),
            "category": task.category,
        },
        "agent_name": AGENT_NAME,
    }


def write_parquet(path: Path, ids: list[str], seed: int = SPLIT_SEED) -> None:
    table = pa.Table.from_pylist([dataset_row(task_id, seed) for task_id in ids], schema=SCHEMA)
    pq.write_table(table, path, compression="zstd", compression_level=3)


def schema_size(task_id: str) -> tuple[int, int]:
    task = load_task(task_id)
    return len(json.dumps(task.functions)), task.index


def tiny_ids(split: str, per_category: int | None, total: int | None, seed: int = SPLIT_SEED) -> list[str]:
    """The tasks of ``split`` with the shortest tool schemas: ``per_category`` of each, or ``total`` overall."""
    ids = task_ids(split, seed)
    if total is not None:
        return sorted(sorted(ids, key=schema_size)[:total], key=ids.index)
    chosen = []
    for category in CATEGORIES:
        of_category = [t for t in ids if load_task(t).category == category]
        chosen += sorted(of_category, key=schema_size)[:per_category]
    return chosen


def split_document(seed: int = SPLIT_SEED) -> dict:
    return {
        "seed": seed,
        "rule": SPLIT_RULE,
        "bfcl_eval_version": upstream.BFCL_EVAL_VERSION,
        "categories": list(CATEGORIES),
        "indices": split_indices(seed),
        "task_ids": {name: task_ids(name, seed) for name in ("train", "val", "test", "heldout")},
    }


def dump_split_document(document: dict) -> str:
    """JSON with one line per list, so the file stays reviewable (json.loads round-trips it)."""

    def dump(value: object, indent: str) -> str:
        if isinstance(value, dict) and value:
            inner = indent + "  "
            items = [f"{inner}{json.dumps(key)}: {dump(item, inner)}" for key, item in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + indent + "}"
        return json.dumps(value)

    return dump(document, "") + "\n"


def generate(out_dir: Path, seed: int = SPLIT_SEED) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPLIT_FILE).write_text(dump_split_document(split_document(seed)), encoding="utf-8")
    write_parquet(out_dir / TRAIN_FILE, task_ids("train", seed), seed)
    write_parquet(out_dir / HELDOUT_FILE, task_ids("heldout", seed), seed)
    write_parquet(out_dir / TINY_TRAIN_FILE, tiny_ids("train", None, 2, seed), seed)
    write_parquet(out_dir / TINY_HELDOUT_FILE, tiny_ids("heldout", 1, None, seed), seed)
    write_parquet(out_dir / GPU_SMOKE_HELDOUT_FILE, tiny_ids("heldout", 2, None, seed), seed)
    write_parquet(out_dir / LEARNING_TRAIN_FILE, LEARNING_TRAIN_IDS, seed)
    return [out_dir / name for name in OUTPUT_FILES]


def check(out_dir: Path, seed: int = SPLIT_SEED) -> list[str]:
    """Names of the files in ``out_dir`` that differ from a fresh regeneration (missing counts)."""
    with tempfile.TemporaryDirectory(prefix="seal-split-") as tmp:
        generate(Path(tmp), seed)
        return [
            name
            for name in OUTPUT_FILES
            if not (out_dir / name).is_file() or not filecmp.cmp(out_dir / name, Path(tmp) / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "data")
    parser.add_argument("--seed", type=int, default=SPLIT_SEED)
    parser.add_argument("--check", action="store_true", help="regenerate to a temp dir and compare bytes")
    args = parser.parse_args(argv)
    if args.check:
        mismatched = check(args.out_dir, args.seed)
        if mismatched:
            print(f"mismatch in {args.out_dir}: {', '.join(mismatched)}", file=sys.stderr)
            return 1
        print(f"ok: {', '.join(OUTPUT_FILES)} reproduce byte-for-byte")
        return 0
    for path in generate(args.out_dir, args.seed):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

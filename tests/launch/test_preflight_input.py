"""Bad input at the start, train/test contamination and a full disk: refused in one or two lines, exit 2, before
Ray or the environment service start; a checkpoint that cannot be written is named with its cause.

The launcher runs as a real subprocess on the CPU recipe composed from the GPU recipe (``exp/SEAL.yaml +swap=cpu``,
as the rehearsal does), with ``env_service.url`` pointing at a closed port: a bad input that slipped through
preflight would end there ("not reachable", before Ray), so no test here can start a cluster, and each says which
check refused. The full disk is a small tmpfs mounted in a private mount namespace (``unshare``), so nothing on
this machine fills up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seal.launch.memory_estimate import checkpoint_disk
from seal.launch.preflight import _check_data, _check_model
from seal.launch.recipe import compose_recipe

ROOT = Path(__file__).resolve().parents[2]
SEAL = str(ROOT / "exp" / "SEAL.yaml")
CLOSED_PORT = "env_service.url=http://127.0.0.1:9"
TRAIN = ROOT / "data" / "cpu_tiny_train.parquet"
HELDOUT = ROOT / "data" / "cpu_tiny_heldout.parquet"


def launcher(tmp_path: Path, *overrides: str, conf: str = SEAL, env: dict | None = None, wrap=()):
    """``python launcher.py`` on the CPU recipe composed from ``conf``; (rc, stderr lines, run folder)."""
    run_dir = tmp_path / "run"
    cpu = ["+swap=cpu", CLOSED_PORT, f"seal.run_dir={run_dir}"] if conf == SEAL else []
    proc = subprocess.run(
        [*wrap, sys.executable, "launcher.py", "--conf", conf, *cpu, *overrides],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr.splitlines(), run_dir


def assert_refused(rc: int, err: list[str], run_dir: Path, *says: str) -> None:
    text = "\n".join(err)
    assert rc == 2 and len(err) <= 2, text
    assert all(s in text for s in says), text
    assert "not reachable" not in text and "Traceback" not in text and "{" not in text, text
    assert not run_dir.exists()  # the service (and Ray) would have made it


def write_rows(path: Path, rows: list[dict], schema=None) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def rows_of(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# ---- bad input ------------------------------------------------------------------------------------


def test_malformed_recipe_yaml_is_one_line_with_its_position(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("defaults:\n  - SEAL\ndata:\n  train_files: [data/bfcl_train.parquet\n  seed: 1\n")
    rc, err, run_dir = launcher(tmp_path, conf=str(recipe))
    assert_refused(rc, err, run_dir, str(recipe), "line 5", "not valid YAML")


def hub_cache_with(root: Path, model: str) -> Path:
    """A Hugging Face cache (its on-disk layout) holding ``model``'s config.json."""
    repo = root / ("models--" + model.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    return root


def test_a_hub_id_typo_offline_is_refused_and_a_cached_id_is_not(tmp_path, monkeypatch):
    cache = hub_cache_with(tmp_path / "hub", "Qwen/Qwen2.5-7B-Instruct")
    typo = "Qwen/Qwen2.5-7B-Instrukt"
    rc, err, run_dir = launcher(tmp_path, f"actor_rollout_ref.model.path={typo}", env={"HF_HUB_CACHE": str(cache)})
    assert_refused(rc, err, run_dir, repr(typo), "nor in the Hugging Face cache", str(cache), "spelling")

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    problems, warnings = [], []
    _check_model(compose_recipe(SEAL, []), problems, warnings)  # offline, and in the cache: it runs
    assert problems == [] and warnings == []


@pytest.mark.parametrize("built", ["tiny_model.out_dir", "tiny_model.warm_start.out_dir"])
def test_a_model_the_recipe_builds_is_not_looked_up_offline(tmp_path, monkeypatch, built):
    """A CPU recipe's tiny model (and its warm start) do not exist before ``prepare`` builds them: not refused as
    a hub id missing from the cache (the learning check's first run on a fresh clone)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "not-built-yet"
    config = compose_recipe(
        str(ROOT / "exp" / "cpu_learning.yaml"), [f"seal.{built}={folder}", f"actor_rollout_ref.model.path={folder}"]
    )
    problems, warnings = [], []
    _check_model(config, problems, warnings)
    assert problems == [] and warnings == []
    _check_model(
        compose_recipe(str(ROOT / "exp" / "cpu_learning.yaml"), [f"actor_rollout_ref.model.path={folder}"]),
        problems,
        warnings,
    )
    assert len(problems) == 1 and "does not exist" in problems[0]  # a folder nothing builds is still refused


def _task_id_none(path: Path) -> str:
    rows = rows_of(TRAIN)
    rows[1]["extra_info"]["task_id"] = None
    return write_rows(path, rows, pq.read_schema(TRAIN))


def _corrupt(path: Path) -> None:
    path.write_bytes(b"PAR1" + b"\0" * 64)  # parquet's magic, then nothing a reader can use


BAD_FILES = {
    "empty": (lambda p: write_rows(p, [], pq.read_schema(TRAIN)), ["has no rows"]),
    "corrupt": (_corrupt, ["is not a readable parquet file"]),
    "no_extra_info": (
        lambda p: write_rows(p, [{k: v for k, v in r.items() if k != "extra_info"} for r in rows_of(TRAIN)]),
        ["has no extra_info column"],
    ),
    "task_id_none": (_task_id_none, ["row 1", "extra_info.task_id is None"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_data_file_is_named_with_what_is_wrong(tmp_path, case):
    make, says = BAD_FILES[case]
    path = tmp_path / f"{case}.parquet"
    make(path)
    rc, err, run_dir = launcher(tmp_path, f"data.train_files={path}")
    assert_refused(rc, err, run_dir, f"data.train_files: {str(path)!r}", *says)
    assert "env_service.bfcl" not in "\n".join(err)  # the data's fault, not the environment block's


# ---- train/test contamination ---------------------------------------------------------------------


def test_a_held_out_task_in_the_train_file_is_refused_by_id(tmp_path):
    leaked = rows_of(HELDOUT)[0]
    path = write_rows(tmp_path / "train.parquet", [*rows_of(TRAIN), leaked], pq.read_schema(TRAIN))
    rc, err, run_dir = launcher(tmp_path, f"data.train_files={path}")
    assert_refused(rc, err, run_dir, "held-out split", leaked["extra_info"]["task_id"])


def test_train_and_validation_files_must_not_share_tasks(tmp_path):
    shared = rows_of(TRAIN)[0]
    val = write_rows(tmp_path / "val.parquet", [*rows_of(HELDOUT), shared], pq.read_schema(TRAIN))
    config = compose_recipe(SEAL, ["+swap=cpu", f"data.val_files={val}"])
    problems = []
    _check_data(config, problems)
    assert len(problems) == 1 and "share 1" in problems[0] and shared["extra_info"]["task_id"] in problems[0], problems

    evaluation = compose_recipe(SEAL, ["+swap=cpu", f"data.val_files={val}", "trainer.val_only=true"])
    problems = []
    _check_data(evaluation, problems)  # an evaluation trains nothing: any task may be validated
    assert problems == []

    problems = []  # the learning check trains on its one task and never validates (val_files names the same file)
    _check_data(compose_recipe(str(ROOT / "exp" / "cpu_learning.yaml"), []), problems)
    assert problems == []


def test_many_shared_ids_are_shown_as_a_few_and_a_count(tmp_path):
    heldout = rows_of(ROOT / "data" / "bfcl_heldout.parquet")
    path = write_rows(tmp_path / "train.parquet", heldout[:10], pq.read_schema(TRAIN))
    config = compose_recipe(SEAL, ["+swap=cpu", f"data.train_files={path}"])
    problems = []
    _check_data(config, problems)
    ids = [r["extra_info"]["task_id"] for r in heldout[:10]]
    assert len(problems) == 1 and "10 (" in problems[0] and "and 7 more" in problems[0], problems
    assert ids[0] in problems[0] and ids[-1] not in problems[0]


# ---- a full disk --------------------------------------------------------------------------------------


def private_tmpfs(size: str) -> list[str]:
    """A command prefix that runs the rest with a ``size`` tmpfs mounted on its first argument, in a private mount
    namespace (root, or an unprivileged user namespace); skip where neither is allowed."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
    )
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    script = f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]


def test_preflight_refuses_a_disk_too_small_for_the_checkpoints(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    rc, err, run_dir = launcher(tmp_path, f"trainer.default_local_dir={disk}", wrap=[*private_tmpfs("1m"), str(disk)])
    assert_refused(rc, err, run_dir, f"trainer.default_local_dir {str(disk)!r}", "checkpoint(s) of", "free there")


def test_the_7b_recipe_checkpoint_is_the_91_gb_measured_and_periodic_saves_keep_one_more():
    """91 GB: a checkpoint of exp/SEAL.yaml's actor (fp32 weights + Adam) as measured on disk (issue 23)."""
    seal = checkpoint_disk(compose_recipe(SEAL, []))
    assert abs(seal.checkpoint_bytes / 1e9 - 91) < 1.5
    assert checkpoint_disk(compose_recipe(SEAL, ["trainer.save_freq=10"])).at_once == seal.at_once + 1


SAVE_ON_A_FULL_DISK = """
import os, sys, torch
from seal.trainer import CheckpointSaveError, explained_save_failure

root = sys.argv[1]
previous = os.path.join(root, "global_step_1")
os.makedirs(previous)
torch.save(torch.arange(64 * 1024, dtype=torch.float32), os.path.join(previous, "model.pt"))  # 256 KiB: fits
with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
    f.write("1")
step = os.path.join(root, "global_step_2")
try:
    with explained_save_failure(step):
        os.makedirs(step)
        torch.save(torch.zeros(1024 * 1024), os.path.join(step, "model.pt"))  # 4 MiB: the disk is full
except CheckpointSaveError as exc:
    print("error:", exc)
    print("cause:", repr(exc.__cause__))
intact = torch.equal(torch.load(os.path.join(previous, "model.pt")), torch.arange(64 * 1024, dtype=torch.float32))
print("previous intact:", intact, "partial left:", os.path.exists(step))
"""


def test_a_save_on_a_full_disk_names_the_path_and_the_cause_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        [*private_tmpfs("1m"), str(disk), sys.executable, "-c", SAVE_ON_A_FULL_DISK, str(disk)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.splitlines()
    error = [line for line in lines if line.startswith("error:")]
    assert len(error) == 1, proc.stdout + proc.stderr
    assert str(disk / "global_step_2") in error[0] and "No space left on device (ENOSPC)" in error[0]
    assert "previous intact: True partial left: False" in lines, proc.stdout


def test_ray_hands_the_launcher_a_save_error_it_can_catch():
    """The save fails in Ray's task runner; the launcher catches it by class (and prints its cause in one line)."""
    from ray.exceptions import RayTaskError

    from seal.trainer import CheckpointSaveError

    raised = RayTaskError(
        "run", "Traceback ...", CheckpointSaveError("cannot save checkpoint /x: ...")
    ).as_instanceof_cause()
    assert isinstance(raised, CheckpointSaveError)
    assert str(raised.cause) == "cannot save checkpoint /x: ..."

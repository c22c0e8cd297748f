"""``python -m env_service``: prompt, score, replay and serve.

Most commands run through ``main(argv)`` in this process (fast); one ``prompt`` and ``serve`` run as
real subprocesses so the module entry point itself is covered.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from env_service.__main__ import main
from env_service.bfcl import tasks
from env_service.bfcl.calls import parse_call_string
from env_service.bfcl.config import EnvConfig
from env_service.bfcl.episode import Episode
from env_service.http.service import ServerThread
from tests.support.processes import REPO, repo_environment

OBS_LITE = {"observation_lite": {"enable": True}}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = repo_environment()
    return subprocess.run(
        [sys.executable, "-m", "env_service", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def gt_record(task_id: str) -> dict:
    task = tasks.load_task(task_id)
    turns = [[parse_call_string(c, task).to_dict() for c in turn] for turn in task.ground_truth]
    return {"id": task_id, "turns": turns}


# ---------------------------------------------------------------------------------------------
# prompt
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "validate"])
def test_prompt_equals_episode_initial_messages(capsys, mode):
    assert main(["prompt", "multi_turn_miss_func_3", "--mode", mode, "--config", json.dumps(OBS_LITE)]) == 0
    printed = json.loads(capsys.readouterr().out)
    task = tasks.load_task("multi_turn_miss_func_3")
    assert printed == {"messages": Episode(task, mode, EnvConfig.from_dict(OBS_LITE)).initial_messages()}
    # observation-lite is train-only: the two modes must differ exactly there
    assert ("[required]" in printed["messages"][0]["content"]) is (mode == "train")


def test_prompt_reads_a_recipe_yaml(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer:\n  total_epochs: 6\nenv_service:\n  bfcl:\n    observation_lite:\n      enable: true\n")
    assert main(["prompt", "multi_turn_base_0", "--mode", "train", "--config", str(recipe)]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = Episode(tasks.load_task("multi_turn_base_0"), "train", EnvConfig.from_dict(OBS_LITE))
    assert printed["messages"] == expected.initial_messages()


def test_prompt_subprocess_entry_point():
    proc = run_cli("prompt", "multi_turn_base_0", "--mode", "validate")
    assert proc.returncode == 0, proc.stderr
    expected = Episode(tasks.load_task("multi_turn_base_0"), "validate", EnvConfig()).initial_messages()
    assert json.loads(proc.stdout) == {"messages": expected}


@pytest.mark.parametrize(
    "args,needle",
    [
        (["prompt", "multi_turn_base_999", "--mode", "train"], "unknown task_id"),
        (["prompt", "multi_turn_base_0", "--mode", "train", "--config", '{"bogus": 1}'], "bogus"),
        (["prompt", "multi_turn_base_0", "--mode", "train", "--config", "{not json"], "neither a file nor valid JSON"),
    ],
)
def test_prompt_bad_input_exits_2(capsys, args, needle):
    assert main(args) == 2
    assert needle in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# score
# ---------------------------------------------------------------------------------------------


def test_score_gt_valid_and_emptied_turn_invalid(tmp_path):
    good = gt_record("multi_turn_base_0")
    emptied = gt_record("multi_turn_base_0")
    emptied["turns"][1] = []
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(good) + "\n\n" + json.dumps(emptied) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["score", "--input", str(source), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["valid"] for r in rows] == [True, False]
    assert rows[0]["id"] == "multi_turn_base_0" and rows[1]["tags"][1] == "empty_turn_model_response"


def test_score_passes_all_800_ground_truth_trajectories(tmp_path):
    from env_service.bfcl.tasks import all_task_ids

    ids = all_task_ids()
    source, out = tmp_path / "gt.jsonl", tmp_path / "scored.jsonl"
    source.write_text("".join(json.dumps(gt_record(task_id)) + "\n" for task_id in ids))
    assert main(["score", "--input", str(source), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(ids) == 800 and [r["id"] for r in rows] == ids
    assert all(r["valid"] and r["progress"] == 1.0 for r in rows)


def test_score_writes_stdout_by_default(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(gt_record("multi_turn_long_context_3")) + "\n")
    assert main(["score", "--input", str(source)]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True


@pytest.mark.parametrize(
    "bad_line,needle",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "multi_turn_base_0"}', '"turns"'),
        ('{"id": "multi_turn_nope_1", "turns": []}', "unknown task id"),
        ('{"id": "multi_turn_base_0", "turns": [[{"name": 1}]]}', "turn 0 call 0"),
    ],
)
def test_score_bad_line_names_line_number_and_exits_2(tmp_path, capsys, bad_line, needle):
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    source.write_text(json.dumps(gt_record("multi_turn_base_0")) + "\n" + bad_line + "\n")
    assert main(["score", "--input", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2" in err and needle in err, err
    assert not out.exists()  # nothing half-written


def test_score_reports_every_bad_line_including_one_nested_too_deeply(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    source.write_text(
        "\n".join([json.dumps(gt_record("multi_turn_base_0")), deep, "{not json", '{"id": "multi_turn_base_0"}']) + "\n"
    )
    assert main(["score", "--input", str(source)]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: JSON nested too deeply" in err and f"{source}:3" in err and f"{source}:4" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink", "dotted"])
def test_score_refuses_to_overwrite_its_input(tmp_path, capsys, alias):
    source = tmp_path / "in.jsonl"
    text = json.dumps(gt_record("multi_turn_base_0")) + "\n"
    source.write_text(text)
    output = {
        "same": source,
        "symlink": tmp_path / "link.jsonl",
        "hardlink": tmp_path / "hard.jsonl",
        "dotted": tmp_path / "." / "in.jsonl",
    }[alias]
    if alias == "symlink":
        output.symlink_to(source)
    if alias == "hardlink":
        os.link(source, output)
    assert main(["score", "--input", str(source), "--output", str(output)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert source.read_text() == text


def test_score_replaces_the_output_atomically(tmp_path, monkeypatch, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(gt_record("multi_turn_base_0")) + "\n")
    out.write_text("previous verdicts\n")
    out.chmod(0o644)

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)  # the write fails at the last moment ...
    assert main(["score", "--input", str(source), "--output", str(out)]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert out.read_text() == "previous verdicts\n"  # ... and the old output is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no temporary left
    monkeypatch.undo()
    assert main(["score", "--input", str(source), "--output", str(out)]) == 0
    assert json.loads(out.read_text())["valid"] is True
    assert (out.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_score_missing_file_exits_2(tmp_path, capsys):
    assert main(["score", "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------


def test_replay_heldout_subset_in_process(capsys, tmp_path):
    report = tmp_path / "replay.json"
    assert main(["replay", "--split", "heldout", "--limit", "8", "--no-progress", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out
    for category in tasks.CATEGORIES:
        assert category in out
    data = json.loads(report.read_text())
    assert data["summary"]["total"] == {
        "tasks": 8,
        "passed": 8,
        "expected_failures": 0,
        "unexpected_failures": 0,
        "errors": 0,
    }


def test_replay_expected_unsolvable_task_does_not_fail(capsys):
    assert main(["replay", "--tasks", "multi_turn_miss_func_49", "multi_turn_base_4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "multi_turn_miss_func_49  [expected]" in out and "result: OK" in out


def test_replay_over_http_train_mode(capsys):
    with ServerThread() as server:
        code = main(
            [
                "replay",
                "--split",
                "train",
                "--limit",
                "8",
                "--concurrency",
                "4",
                "--url",
                server.url,
                "--mode",
                "train",
                "--config",
                json.dumps(OBS_LITE),
                "--no-progress",
            ]
        )
        assert code == 0
        assert server.manager.stats()["live"] == 0  # every episode released
    assert "total               8       8" in capsys.readouterr().out


def test_replay_pool_is_sized_to_its_concurrency(monkeypatch, capsys):
    from env_service import replay

    seen = {}

    def capture(client, task_ids, **kwargs):
        seen["pool"] = client.session.get_adapter(client.url)._pool_maxsize
        return []

    monkeypatch.setattr(replay, "replay_split", capture)
    with ServerThread() as server:
        main(["replay", "--limit", "1", "--concurrency", "3", "--url", server.url, "--no-progress"])
    assert seen["pool"] == 3


def test_replay_stops_early_when_the_service_dies(capsys):
    import threading

    from env_service import replay
    from env_service.client import EnvClient

    server = ServerThread().start()
    client = EnvClient(server.url)  # default retries: each request gives up after ~3.5 s of backoff
    ids = tasks.task_ids("train")[:40]
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(results=replay.replay_split(client, ids, concurrency=4)))
    runner.start()
    deadline = time.monotonic() + 120
    while server.manager.stats()["evaluations"] < 2:
        assert time.monotonic() < deadline and runner.is_alive()
        time.sleep(0.05)
    server.stop()
    stopped = time.monotonic()
    runner.join(120)
    # Without the early stop every remaining task spent its own retries: ~30 s here, 78 s for the heldout split.
    assert time.monotonic() - stopped < 12
    errors = [r.error for r in outcome["results"]]
    assert errors.count(replay.SKIPPED_UNREACHABLE) >= 20, errors


def test_replay_unreachable_url_exits_2(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["replay", "--limit", "1", "--url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    assert "--url" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------


def test_serve_answers_health_then_terminates():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = repo_environment()
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_service", "serve", "--port", str(port), "--log-level", "warning"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                health = requests.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "service did not come up"
                time.sleep(0.2)
        assert health["status"] == "ok" and health["live"] == 0
        created = requests.post(
            f"http://127.0.0.1:{port}/create", timeout=10, json={"task_id": "multi_turn_base_0", "mode": "validate"}
        ).json()
        assert created["messages"][0]["role"] == "system"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)

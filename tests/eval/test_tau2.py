"""tau2-bench through ``python -m seal.eval endpoint --categories tau2_*``, against scripted loopback stubs.

The stubs (``tests/support/tau2_stubs.py``) play tau2's agent and user: per domain two tasks walk the task's ground-truth
actions (telecom's user-side steps done by the user stub on its device) and one stops short of them; one retail
task does every action but leaves out what it should have told the user. Checked:

* the rewards are tau2's own: ``tau2.evaluator.evaluate_simulation`` on the simulations our run saved gives
  each record's reward, and the pattern is pass, pass, fail in every domain (so both outcomes are exercised);
* tau2's own runner (``run_domain``, what ``tau2 run`` calls, with its defaults) with the same stubs gives the
  same reward task by task;
* a rerun skips finished tasks without starting tau2; the report puts the domains in the OOD table.

These run in the tau2 environment (``bash scripts/install.sh tau2``; ``$SEAL_TAU2_VENV``, default .venv-tau2),
skipped without it, failed without it under CI=true. The skip messages of a category whose requirements are
missing are checked without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seal.eval.__main__ import main as seal_eval
from seal.results.records import load_records
from seal.results.tau2_tasks import tau2_task_id
from tests.support.side_venv import require_side_venv
from tests.support.tau2_stubs import AGENT_MODEL, USER_MODEL, StubServer

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SEAL_TAU2_VENV", REPO / ".venv-tau2"))
VENV_PYTHON = VENV / "bin" / "python"
TAU2_ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": "stub"}

#: (tau2 task id, "pass" | "fail" | "silent", actions a failing agent still does): a failing one stops before a
#: write; a silent one does every action but never tells the user what the task wants communicated (tau2's reward
#: multiplies the database check by the communication check: 0, though the database matches).
TASKS = {
    "retail": [("2", "pass", 0), ("4", "pass", 0), ("5", "fail", 4), ("3", "silent", 0)],
    "airline": [("7", "pass", 0), ("8", "pass", 0), ("2", "fail", 3)],
    "telecom": [
        ("[mobile_data_issue]airplane_mode_on|data_mode_off[PERSONA:None]", "pass", 0),
        ("[service_issue]airplane_mode_on|lock_sim_card_pin[PERSONA:Easy]", "pass", 0),
        ("[mobile_data_issue]airplane_mode_on|bad_network_preference[PERSONA:Hard]", "fail", 1),
    ],
}

# Runs in the tau2 venv: the scripted plan of each task from tau2's own task data.
DUMP_TASKS = """
import json, sys
from tau2.run import get_tasks
wanted = json.loads(sys.argv[1])
plans = {}
for domain, entries in wanted.items():
    tasks = {t.id: t for t in get_tasks(task_set_name=domain, task_split_name="base")}
    for task_id, mode, fail_after in entries:
        criteria = tasks[task_id].evaluation_criteria
        plans[f"{domain}:{task_id}"] = {
            "marker": str(tasks[task_id].user_scenario),
            "mode": mode,
            "fail_after": fail_after,
            "actions": [{"requestor": a.requestor, "name": a.name, "arguments": a.arguments} for a in criteria.actions or []],
            "communicate": list(criteria.communicate_info or []),
        }
print("PLANS " + json.dumps(plans))
"""

# Runs in the tau2 venv, one process (importing tau2 takes seconds): (1) tau2's evaluator on the simulations our
# run saved -> {file: reward}; (2) tau2's own runner (``run_domain``, what ``tau2 run`` calls) on the same tasks with
# the same stubs and the CLI's defaults -> {domain: {task id: reward}}.
THEIRS = """
import json, sys
from tau2.data_model.simulation import RunConfig, SimulationRun
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.run import get_tasks, run_domain
saved, tasks, stub_url, results_dir = json.loads(sys.argv[1])
evaluated = {}
for domain, path in saved:
    simulation = SimulationRun.model_validate_json(open(path).read())
    task = next(t for t in get_tasks(task_set_name=domain, task_split_name="base") if t.id == simulation.task_id)
    info = evaluate_simulation(simulation=simulation, task=task, evaluation_type=EvaluationType.ALL,
                               solo_mode=False, domain=domain)
    evaluated[path] = info.reward
runner = {}
llm_args = {"base_url": stub_url, "temperature": 0}
for domain, entries in tasks.items():
    config = RunConfig(domain=domain, task_ids=[t for t, _, _ in entries], llm_agent="openai/stub-agent",
                       llm_args_agent=llm_args, llm_user="openai/stub-user", llm_args_user=llm_args,
                       llm_args_judge={}, max_concurrency=3, save_to=domain, results_dir=results_dir)
    results = run_domain(config)
    runner[domain] = {s.task_id: s.reward_info.reward for s in results.simulations}
print("THEIRS " + json.dumps({"evaluated": evaluated, "runner": runner}))
"""


def tau2_output(code: str, *args: str, prefix: str) -> dict:
    proc = subprocess.run(
        [str(VENV_PYTHON), "-c", code, *args], capture_output=True, text=True, env=TAU2_ENV, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith(prefix))
    return json.loads(line[len(prefix) :])


@pytest.fixture(scope="module")
def tau2_venv():
    require_side_venv(VENV_PYTHON, "tau2-bench", "tau2")


@pytest.fixture(scope="module")
def stub(tau2_venv):
    plans = tau2_output(DUMP_TASKS, json.dumps(TASKS), prefix="PLANS ")
    with StubServer(plans) as server:
        yield server


def run_seal_eval(stub: StubServer, out: Path) -> subprocess.CompletedProcess:
    ids = ",".join(tau2_task_id(domain, t) for domain, entries in TASKS.items() for t, _, _ in entries)
    command = [sys.executable, "-m", "seal.eval", "endpoint", "--endpoint", stub.url, "--model", AGENT_MODEL]
    command += ["--user-endpoint", stub.url, "--user-model", USER_MODEL, "--ids", ids, "--out", str(out)]
    env = {**os.environ, "SEAL_TAU2_VENV": str(VENV)}
    return subprocess.run(command + ["--no-progress"], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def ours(stub, tmp_path_factory):
    out = tmp_path_factory.mktemp("tau2_eval")
    proc = run_seal_eval(stub, out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, {r["task_id"]: r for r in load_records(str(out / "results.jsonl"))}


@pytest.fixture(scope="module")
def theirs(ours, stub, tmp_path_factory):
    _, records = ours
    saved = [(r["category"].removeprefix("tau2_"), r["source"]["simulation"]) for r in records.values()]
    arguments = [saved, TASKS, stub.url, str(tmp_path_factory.mktemp("tau2_runner"))]
    return tau2_output(THEIRS, json.dumps(arguments), prefix="THEIRS ")


def test_rewards_are_tau2s_own_evaluation_of_the_saved_simulations(ours, theirs):
    out, records = ours
    for domain, entries in TASKS.items():
        rewards = [records[tau2_task_id(domain, t)]["reward"] for t, _, _ in entries]
        assert rewards == [1.0 if mode == "pass" else 0.0 for _, mode, _ in entries], domain
    assert {r["source"]["simulation"]: r["reward"] for r in records.values()} == theirs["evaluated"]
    assert all(r["valid"] == (r["reward"] == 1.0) and not r["failed"] for r in records.values())
    table = json.loads((out / "table.json").read_text())["ood_table"]
    assert {c: (table[c]["passed"], table[c]["n"]) for c in table} == {
        "tau2_retail": (2, 4),
        "tau2_airline": (2, 3),
        "tau2_telecom": (2, 3),
    }


def test_tau2s_own_runner_with_the_same_stubs_gives_the_same_rewards(ours, theirs):
    _, records = ours
    for domain, entries in TASKS.items():
        ours_by_task = {t: records[tau2_task_id(domain, t)]["reward"] for t, _, _ in entries}
        assert theirs["runner"][domain] == ours_by_task, domain


def test_a_rerun_skips_finished_tasks_without_starting_tau2(ours, stub):
    out, records = ours
    before = dict(stub.requests)
    proc = run_seal_eval(stub, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all already in" in proc.stdout and stub.requests == before
    assert len(load_records(str(out / "results.jsonl"))) == len(records)


def test_a_category_whose_requirements_are_missing_is_skipped_naming_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEAL_TAU2_VENV", str(tmp_path / "no-venv"))
    argv = ["endpoint", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--categories", "tau2_airline"]
    assert seal_eval(argv + ["--out", str(tmp_path / "out"), "--no-progress"]) == 1  # nothing ran
    said = capsys.readouterr().out
    assert f"tau2_airline skipped: needs the tau2 environment at {tmp_path / 'no-venv'}" in said
    assert "`bash scripts/install.sh tau2`" in said and "a user simulator (--user-endpoint and --user-model)" in said


def test_checkpoint_refuses_tau2_and_names_the_endpoint_path(tmp_path, capsys):
    argv = ["checkpoint", "--categories", "tau2_retail", "--out", str(tmp_path), "--no-progress"]
    assert seal_eval(argv) == 2
    assert "`python -m seal.eval endpoint --serve CHECKPOINT --model NAME ...`" in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


def test_success_is_tau2s_reward_within_its_own_tolerance():
    """tau2 counts a simulation as a success when its reward is within 1e-6 of 1 (its ``is_successful``, written
    out here): a reward summed to 0.9999999 passes, 0.99 does not."""
    from seal.eval.tau2 import record_of

    def tau2_is_successful(reward: float) -> bool:
        return (1 - 1e-6) <= reward <= (1 + 1e-6)

    for reward in (1.0, 0.9999999, 1.0000001, 0.999998, 0.99, 0.0):
        line = {"domain": "retail", "task_id": "0", "reward": reward, "agent_messages": 1}
        line |= {"termination_reason": "agent_stop", "simulation_file": "s.json"}
        assert record_of(line, {})["valid"] is tau2_is_successful(reward), reward

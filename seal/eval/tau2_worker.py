"""tau2-bench simulations with tau2's own pieces, run inside the tau2 environment (``bash scripts/install.sh tau2``).

    python -m seal.eval.tau2_worker --plan PLAN.json --agent-model NAME --agent-base-url URL
                                    --user-model NAME --user-base-url URL --out DIR

PLAN: ``{"domains": {domain: [tau2 task ids] or null (the whole split)}, "limit": N or null, "done": {domain:
[task ids already in the results file]}}``.

``seal.eval`` starts this in the tau2 venv (its pins clash with verl's), once for all domains (importing tau2
takes seconds); it imports tau2 and the standard library only. Per task of a domain's ``base`` split: tau2's ``run_task`` (its environment, its ``llm_agent`` speaking
OpenAI function calling to the agent endpoint through litellm, its ``user_simulator`` on the user endpoint, its
orchestrator) and tau2's ``evaluate_simulation`` (the reward, as ``tau2 run`` computes it). The simulation is saved
as tau2's JSON under ``DIR/<domain>/``; one ``RESULT_PREFIX`` line per task goes to stdout for ``seal.eval``.
Settings are ``tau2 run``'s defaults (temperature 0, 200 steps, 10 errors, seed 300, 3 retries); API keys come from
``$SEAL_TAU2_AGENT_API_KEY``/``$SEAL_TAU2_USER_API_KEY``/``$SEAL_TAU2_JUDGE_API_KEY`` (a placeholder when unset,
as ``tau2 run`` does), never the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

from seal.results.tau2_tasks import TASK_SPLIT

RESULT_PREFIX = "SEAL_TAU2 "
MAX_STEPS = 200
MAX_ERRORS = 10
SEED = 300
MAX_RETRIES = 3


def simulation_file(out_dir: str, domain: str, task_id: str) -> str:
    """A file name for any tau2 task id (telecom's hold ``[``, ``|``, ``:``): readable prefix + short hash."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", task_id)[:80]
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:10]
    return os.path.join(out_dir, domain, f"{safe}-{digest}.json")


def llm_args(base_url: str, key_env: str) -> dict:
    # run_domain's handling: no /chat/completions suffix, its retries, a placeholder key when none is set
    return {
        "base_url": base_url.rstrip("/").removesuffix("/chat/completions"),
        "api_key": os.environ.get(key_env) or "dummy_key",
        "temperature": 0.0,
        "num_retries": MAX_RETRIES,
    }


def trial_seed() -> int:
    """The seed ``tau2 run`` gives the first trial (``run_tasks``: ``random.seed(seed)``, one draw per trial)."""
    return random.Random(SEED).randint(0, 1000000)


def select(domain: str, ids: list[str] | None, limit: int | None, done: set[str]):
    from tau2.run import get_tasks

    tasks = get_tasks(task_set_name=domain, task_split_name=TASK_SPLIT)
    known = {t.id for t in tasks}
    unknown = [t for t in ids or [] if t not in known]
    if unknown:
        raise SystemExit(f"unknown {domain} task ids (split {TASK_SPLIT}): {unknown}")
    chosen = [t for t in tasks if t.id in set(ids)] if ids else tasks[:limit]
    return len(chosen), [t for t in chosen if t.id not in done]


def run_one(domain: str, task, args) -> dict:
    from tau2.evaluator.evaluator import EvaluationType
    from tau2.run import run_task

    judge = {}
    if args.judge_model:
        judge = {
            "judge_llm": args.judge_model,
            "judge_llm_args": llm_args(args.judge_base_url, "SEAL_TAU2_JUDGE_API_KEY"),
        }
    result = {"domain": domain, "task_id": task.id}
    try:
        simulation = run_task(
            domain=domain,
            task=task,
            agent="llm_agent",
            user="user_simulator",
            llm_agent=args.agent_model,
            llm_args_agent=llm_args(args.agent_base_url, "SEAL_TAU2_AGENT_API_KEY"),
            llm_user=args.user_model,
            llm_args_user=llm_args(args.user_base_url, "SEAL_TAU2_USER_API_KEY"),
            max_steps=MAX_STEPS,
            max_errors=MAX_ERRORS,
            evaluation_type=EvaluationType.ALL,
            seed=trial_seed(),
            **judge,
        )
    except Exception as error:  # noqa: BLE001 - an endpoint that kept failing: recorded as failed, rerun retries
        return {**result, "error": f"{type(error).__name__}: {error}"[:500]}
    simulation.trial = 0
    path = simulation_file(args.out, domain, task.id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(simulation.model_dump_json(indent=1))
    return {
        **result,
        "reward": float(simulation.reward_info.reward),
        "termination_reason": str(getattr(simulation.termination_reason, "value", simulation.termination_reason)),
        "agent_messages": sum(1 for m in simulation.messages if m.role == "assistant"),
        "simulation_file": path,
    }


def emit(line: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(line) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="JSON file: the domains, task ids, limit and finished ids")
    parser.add_argument("--agent-model", required=True, help="litellm model id, e.g. openai/NAME")
    parser.add_argument("--agent-base-url", required=True)
    parser.add_argument("--user-model", required=True)
    parser.add_argument("--user-base-url", required=True)
    parser.add_argument("--judge-model")
    parser.add_argument("--judge-base-url")
    parser.add_argument("--out", required=True, help="folder for the simulations (<out>/<domain>/*.json)")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    from tau2.run import logger  # tau2's (loguru's) logger, the one its runner configures

    logger.remove()  # tau2 logs every step at DEBUG/INFO; its CLI default is ERROR
    logger.add(sys.stderr, level="ERROR")

    with open(args.plan, encoding="utf-8") as f:
        plan = json.load(f)
    pending = []
    for domain, ids in plan["domains"].items():
        selected, todo = select(domain, ids, plan.get("limit"), set(plan.get("done", {}).get(domain, [])))
        emit({"domain": domain, "selected": selected, "pending": len(todo)})
        pending += [(domain, task) for task in todo]
    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        for future in as_completed([pool.submit(run_one, domain, task, args) for domain, task in pending]):
            emit(future.result())
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every simulation file is closed and every line flushed; the interpreter's teardown of litellm's thousands of
    # modules would add seconds per run.
    os._exit(status)

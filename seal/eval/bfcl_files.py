"""Our results in bfcl-eval's own result-file layout, scored by bfcl's own ``evaluate``.

bfcl reads ``<result dir>/<model dir>/multi_turn/BFCL_v4_multi_turn_<category>_result.json`` (one JSON object
per line: ``{"id", "result": [[step text, ...] per user turn]}``), decodes each step text with the model's
handler and runs its ``multi_turn_checker``. We write each step as the tool calls the environment *ran*, rendered
in the Qwen function-calling format (``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``), and name the model
``Qwen/Qwen3-8B-FC``: bfcl registers no Qwen2.5 model, and the handler registered for that name,
``QwenFCHandler``, decodes exactly this format (JSON arguments, so positional-argument loss of bfcl's Python
prompting decoder cannot occur). Writing the calls that ran rather than the raw text keeps bfcl from running
what our environment refused (a tool not yet revealed, a malformed message) and keeps its ``eval`` away from
unvetted names; it also makes the score independent of the model's own prompt format (ToolACE's Python-list
calls are written the same way). A step with no call that ran is written as "", which bfcl skips.

bfcl's evaluation runs in a subprocess with its own scratch ``BFCL_PROJECT_ROOT``: bfcl keeps backend instances
in module globals, creates directories under its project root at import and reads ``.env`` there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from env_service.vocabulary import CATEGORY_PREFIX
from seal.eval.records import scored

BFCL_MODEL = "Qwen/Qwen3-8B-FC"
VERSION_PREFIX = "BFCL_v4"


def render_step(calls: list[dict]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}\n</tool_call>"
        for c in calls
    )


def bfcl_entry(record: dict) -> dict:
    tokens = record.get("tokens", {})
    return {
        "id": record["task_id"],
        "result": [[render_step(step["calls"]) for step in turn] for turn in record["turns"]],
        "input_token_count": tokens.get("prompt", 0),
        "output_token_count": tokens.get("completion", 0),
    }


def _category_file(folder: str, category: str, kind: str) -> str:
    """bfcl's path of a multi-turn result or score file of our model under ``folder``."""
    name = f"{VERSION_PREFIX}_{CATEGORY_PREFIX}{category}_{kind}.json"
    return os.path.join(folder, BFCL_MODEL.replace("/", "_"), "multi_turn", name)


def result_file(result_dir: str, category: str) -> str:
    return _category_file(result_dir, category, "result")


def score_file(score_dir: str, category: str) -> str:
    return _category_file(score_dir, category, "score")


def write_result_files(records: list[dict], result_dir: str) -> dict[str, str]:
    """One bfcl result file per category present (scored episodes only, sorted by id); returns {category: path}."""
    by_category: dict[str, list[dict]] = {}
    for record in scored(records):
        by_category.setdefault(record["category"], []).append(record)
    paths = {}
    for category, rows in sorted(by_category.items()):
        path = result_file(result_dir, category)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rows.sort(key=lambda r: int(r["task_id"].rsplit("_", 1)[1]))
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(bfcl_entry(row), ensure_ascii=False) + "\n")
        paths[category] = path
    return paths


def run_bfcl_evaluate(root: str, categories: list[str], timeout_s: float = 600) -> dict[str, dict]:
    """bfcl's ``evaluate --partial-eval`` (``seal/eval/bfcl_score.py``) on ``<root>/result``; returns
    {category: {accuracy, correct_count, total_count}} from bfcl's score files (``<root>/score``)."""
    score_dir = os.path.join(root, "score")
    env = {**os.environ, "BFCL_PROJECT_ROOT": os.path.abspath(root)}
    env.setdefault("OPENAI_API_KEY", "unused")  # some bfcl handlers build an API client at construction
    cmd = [sys.executable, "-m", "seal.eval.bfcl_score", os.path.abspath(root), *categories]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    scores = {}
    for category in categories:
        path = score_file(score_dir, category)
        if os.path.exists(path):
            with open(path) as f:
                header = json.loads(f.readline())
            scores[category] = {k: header[k] for k in ("accuracy", "correct_count", "total_count")}
    if len(scores) != len(categories):
        raise RuntimeError(
            f"bfcl evaluate wrote no score for {sorted(set(categories) - set(scores))} "
            f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return scores


def score_with_bfcl(records: list[dict], root: str) -> dict[str, dict]:
    """Write bfcl result files under ``<root>/result`` and score them with bfcl; {category: score}."""
    paths = write_result_files(records, os.path.join(root, "result"))
    return run_bfcl_evaluate(root, sorted(paths)) if paths else {}

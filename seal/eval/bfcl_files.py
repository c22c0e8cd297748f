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

The out-of-distribution categories (``memory_kv``, ``memory_rec_sum``, ``memory_vector``, ``web_search_base``,
``web_search_no_snippet``) go to bfcl's agentic layout (``agentic/memory/<backend>/BFCL_v4_memory_kv_result.json``,
``agentic/BFCL_v4_web_search_base_result.json``), one turn per question. bfcl checks the last step its decoder
finds no call in, so there a message the environment took as the answer (no call ran: plain text, or a message
it could not parse) is written as its text, a message whose calls the environment refused as the calls it
named, and a message whose calls ran as those calls.

bfcl's evaluation runs in a subprocess with its own scratch ``BFCL_PROJECT_ROOT``: bfcl keeps backend instances
in module globals, creates directories under its project root at import and reads ``.env`` there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from env_service.bfcl.ood_tasks import MEMORY_CATEGORIES, OOD_CATEGORIES
from env_service.bfcl.parser import parse_assistant
from env_service.vocabulary import CATEGORY_PREFIX, STEP_PARSE_ERROR
from seal.results.records import scored

BFCL_MODEL = "Qwen/Qwen3-8B-FC"
VERSION_PREFIX = "BFCL_v4"


def render_step(calls: list[dict]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}\n</tool_call>"
        for c in calls
    )


def render_ood_step(step: dict, prompt_mode: str = "bfcl_qwen_fc") -> str:
    """An OOD step as bfcl should read it: its calls that ran, its text if it was the answer, else the calls the
    environment refused (bfcl would have run them: they are no answer either)."""
    if step["calls"]:
        return render_step(step["calls"])
    if step.get("error_type") in (None, STEP_PARSE_ERROR):
        return step["text"]
    named = [{"name": c.name, "arguments": c.arguments} for c in parse_assistant(step["text"], prompt_mode).calls]
    return render_step([c for c in named if isinstance(c["name"], str) and isinstance(c["arguments"], dict)])


def bfcl_entry(record: dict) -> dict:
    tokens = record.get("tokens", {})
    if record["category"] in OOD_CATEGORIES:
        mode = (record.get("source") or {}).get("tool_prompt_mode", "bfcl_qwen_fc")
        result = [[render_ood_step(step, mode) for step in turn] for turn in record["turns"]]
    else:
        result = [[render_step(step["calls"]) for step in turn] for turn in record["turns"]]
    return {
        "id": record["task_id"],
        "result": result,
        "input_token_count": tokens.get("prompt", 0),
        "output_token_count": tokens.get("completion", 0),
    }


def bfcl_category(category: str) -> str:
    """bfcl's name of one of our categories (``base`` -> ``multi_turn_base``; OOD names are bfcl's already)."""
    return category if category in OOD_CATEGORIES else CATEGORY_PREFIX + category


def _category_file(folder: str, category: str, kind: str) -> str:
    """bfcl's path of a result or score file of our model under ``folder``."""
    name = f"{VERSION_PREFIX}_{bfcl_category(category)}_{kind}.json"
    if category in MEMORY_CATEGORIES:
        group = os.path.join("agentic", "memory", category.removeprefix("memory_"))
    else:
        group = "agentic" if category in OOD_CATEGORIES else "multi_turn"
    return os.path.join(folder, BFCL_MODEL.replace("/", "_"), group, name)


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
        rows.sort(key=lambda r: int(r["task_id"].rsplit("_", 1)[1].split("-")[0]))
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

"""Out-of-distribution evaluation: bfcl's memory and web-search categories through the environment service.

Differential tests against bfcl-eval itself: (a) every memory question's verdict equals bfcl's ``agentic_checker``
on many generated answers; (b) scripted prerequisite conversations through the service leave the same memory (and
the same tool results) as bfcl's own executor and backend with bfcl's snapshot files; (c) bfcl's own evaluation
of our results files agrees with our verdicts task by task. Then the skips (vector backend without its embedding
model, web search without a key), the evaluate-only refusals, and the CLI end to end against a scripted endpoint.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from bfcl_eval.eval_checker.agentic_eval.agentic_checker import agentic_checker
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.model_handler.utils import add_memory_instruction_system_prompt
from bfcl_eval.utils import populate_initial_settings_for_memory_test_cases

from env_service.bfcl import ood_tasks
from env_service.bfcl.ood_episode import OodEpisode
from env_service.bfcl.ood_tasks import load_ood_task, ood_task_ids, prereq_chain
from env_service.client import EnvServiceError, InProcessEnvClient
from env_service.control_text import ControlText
from seal.eval.bfcl_files import render_step, score_file, score_with_bfcl
from seal.eval.endpoint import run_episode
from seal.eval.ood import run_ood, select_ood
from seal.results.records import load_records

#: These episodes replay scripted answers: nothing to escape (the escape: tests/env/test_env_text_is_data.py).
NO_MARKUP = ControlText(())

OFFLINE_MEMORY = ("memory_kv", "memory_rec_sum")


@pytest.fixture(scope="module")
def env():
    return InProcessEnvClient()


def _call(name: str, **arguments) -> str:
    return render_step([{"name": name, "arguments": arguments}])


# ---- (a) verdicts equal bfcl's agentic_checker ------------------------------------------------------------------


def _responses(answer: str, wrong: str) -> list[str]:
    """Generated final messages around one possible answer: right, wrong, re-cased, re-punctuated, glued into a word."""
    spaced = " ".join(answer)  # letters apart: bfcl keeps spaces, so only a one-character answer still matches
    dotted = ".".join(answer.split(" ")) if " " in answer else f"*{answer}*"
    return [
        f"{{'answer': '{answer}', 'context': 'from memory'}}",
        f"{{'answer': '{wrong}', 'context': 'a guess'}}",
        answer.upper(),
        f"The answer is ({answer.lower()}).",
        dotted,
        spaced,
        f"x{answer}y",
        "{'answer': 'I do not know', 'context': 'I do not know'}",
    ]


@pytest.mark.parametrize("category", OFFLINE_MEMORY)
def test_every_question_verdict_equals_bfcl_agentic_checker(env, category):
    compared, passed = 0, 0
    ids = ood_task_ids(category)
    assert len(ids) == 155
    for i, task_id in enumerate(ids):
        task = load_ood_task(task_id)
        wrong = load_ood_task(ids[(i + 1) % len(ids)]).possible_answers[0]
        for k, text in enumerate(_responses(task.possible_answers[0], wrong)):
            created = env.create(task_id, "validate")
            iid = created["instance_id"]
            steps = []
            if k % 3 == 1:  # a tool call first: not the answer, bfcl skips it too
                steps.append(_call("core_memory_list_keys" if category == "memory_kv" else "memory_retrieve"))
            if k % 4 == 2:  # an unparseable message is an answer candidate in bfcl (decoding fails), then replaced
                steps.append("<tool_call>\nnot json\n</tool_call>")
            steps.append(text)
            for step in steps:
                reply = env.step(iid, step)
            assert reply["terminated"]
            ours = env.evaluate(iid, release=True)
            expected = agentic_checker(text, task.possible_answers)
            assert ours["valid"] == expected["valid"], (task_id, text, ours, expected)
            assert ours["valid"] == agentic_checker([text], task.possible_answers)["valid"]  # bfcl's list form
            assert ours["error_type"] == expected.get("error_type")
            compared += 1
            passed += ours["valid"]
    # The generated answers must exercise both verdicts.
    assert compared == 155 * 8 and 155 <= passed < compared - 155


def test_a_question_without_an_answer_fails_like_bfcl(env):
    created = env.create("memory_kv_0-customer-0", "validate")
    env.step(created["instance_id"], _call("core_memory_list_keys"))
    ours = env.evaluate(created["instance_id"], release=True)
    assert ours["valid"] is False and ours["error_type"] == "agentic:no_last_message"


# ---- (b) memory state through the service equals bfcl's backend ---------------------------------------------------


def _scripted_calls(category: str, task_id: str, turn: int, user_text: str) -> list[dict]:
    """Calls a model might make in one prerequisite turn, errors included (duplicate keys, missing keys)."""
    words = re.findall(r"[a-z]+", user_text.lower())[:3] or ["note"]
    key = "_".join(words)
    if category == "memory_kv":
        calls = [{"name": "core_memory_add", "arguments": {"key": key, "value": user_text[:120]}}]
        calls.append({"name": "archival_memory_add", "arguments": {"key": f"{key}_{turn}", "value": user_text[:400]}})
        if turn % 3 == 2:
            calls.append({"name": "core_memory_remove", "arguments": {"key": key}})
            calls.append({"name": "archival_memory_replace", "arguments": {"key": "no_such_key", "value": "x"}})
        if turn % 4 == 3:
            calls.append({"name": "archival_memory_key_search", "arguments": {"query": " ".join(words), "k": 2}})
        return calls
    calls = [{"name": "memory_append", "arguments": {"text": f"[{task_id} t{turn}] {user_text[:150]}\n"}}]
    if turn % 3 == 2:
        calls.append({"name": "memory_replace", "arguments": {"old_text": f"t{turn}]", "new_text": f"turn {turn}]"}})
    if turn % 5 == 4:
        calls.append({"name": "memory_retrieve", "arguments": {}})
    return calls


def _as_bfcl_rewrites(value):
    """``value`` with bfcl's rewriting of call strings applied to every text in it: an identifier followed by
    spaces and ``(`` loses the spaces (none of these texts names a memory tool)."""
    if isinstance(value, str):
        return re.sub(r"\b([a-zA-Z_]\w*)\s+(?=\()", r"\1", value)
    if isinstance(value, dict):
        return {k: _as_bfcl_rewrites(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_bfcl_rewrites(v) for v in value]
    return value


def _bfcl_call_string(call: dict) -> str:
    return f"{call['name']}({', '.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"


def _bfcl_chain(category: str, scenario: str, root: Path) -> tuple[list[list[str]], dict]:
    """bfcl's own way: its executor (``eval`` of call strings, instances in its registry) on its backend, with
    snapshot files under a result folder; returns every call's result and the final flushed snapshot."""
    model = f"seal_ood_test_{uuid.uuid4().hex[:8]}"
    results = []
    try:
        for task_id in prereq_chain(category, scenario):
            task = load_ood_task(task_id)
            entry = {"id": task_id, "involved_classes": [task.backend], "scenario": scenario}
            (entry,) = populate_initial_settings_for_memory_test_cases([entry], root)
            instances = {}
            for turn, messages in enumerate(task.question):
                calls = _scripted_calls(category, task_id, turn, messages[-1]["content"])
                out, instances = multi_turn_utils.execute_multi_turn_func_call(
                    [_bfcl_call_string(c) for c in calls], entry["initial_config"], [task.backend], model, task_id
                )
                results.append(out)
            instances[task.backend]._flush_memory_to_local_file()
            snapshot_file = instances[task.backend].latest_snapshot_file
        return results, json.loads(snapshot_file.read_text())
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(model)]:
            del vars(multi_turn_utils)[key]


@pytest.mark.parametrize("category", OFFLINE_MEMORY)
def test_prerequisite_chains_leave_bfcls_memory(env, category, tmp_path):
    for scenario in ood_tasks.MEMORY_SCENARIOS:
        expected_results, expected_snapshot = _bfcl_chain(category, scenario, tmp_path / scenario)
        snapshot, results = None, []
        for task_id in prereq_chain(category, scenario):
            task = load_ood_task(task_id)
            created = env.create(task_id, "validate", memory_snapshot=snapshot)
            iid = created["instance_id"]
            for turn, messages in enumerate(task.question):
                calls = _scripted_calls(category, task_id, turn, messages[-1]["content"])
                reply = env.step(iid, render_step(calls))["message"]["content"]
                results.append(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", reply, re.S))
                done = env.step(iid, "Got it.")
            assert done["terminated"]
            snapshot = env.evaluate(iid, release=True)["memory_snapshot"]
        # bfcl's executor rewrites ``word (`` into ``word(`` inside string arguments before its ``eval`` (its
        # method-call regex; env_service/bfcl/executor.py, divergence 1): our service stores the text as sent.
        assert _as_bfcl_rewrites(results) == expected_results, scenario
        assert _as_bfcl_rewrites(snapshot) == expected_snapshot, scenario
        # A question starts from that memory, and its system prompt is bfcl's for that memory.
        question = next(t for t in ood_task_ids(category) if load_ood_task(t).scenario == scenario)
        system = env.create(question, "validate", memory_snapshot=snapshot)["messages"][0]["content"]
        task = load_ood_task(question)
        instance = OodEpisode(task, memory_snapshot=snapshot)._session.instances[task.backend]
        bfcl_system = add_memory_instruction_system_prompt(task.question, category, scenario, instance)[0][0]
        assert system.startswith(bfcl_system["content"] + "\n\n# Tools\n")
        assert "There is no content in the" not in bfcl_system["content"]


# ---- (c) bfcl's own evaluation of our results files ----------------------------------------------------------------


def _model_for(task_id: str):
    """Scripted: prerequisites store each user message; questions look up memory, then answer right or wrong."""
    task = load_ood_task(task_id)
    state = {"n": 0}
    digest = int(task_id.rsplit("_", 1)[1].split("-")[0])  # the question's number

    def generate(messages):
        state["n"] += 1
        if task.kind == ood_tasks.KIND_PREREQ:
            if task.category == "memory_rec_sum" and state["n"] % 2:
                return _call("memory_append", text=messages[-1]["content"][:80]), {}
            return "Noted.", {}
        if state["n"] == 1 and digest % 3 == 0:
            return _call("memory_retrieve" if task.category == "memory_rec_sum" else "core_memory_list_keys"), {}
        answer = task.possible_answers[0] if digest % 2 else "something else entirely"
        return f"{{'answer': '{answer}', 'context': 'memory'}}", {}

    return generate


def test_bfcl_scores_our_ood_results_as_we_do(env, tmp_path):
    def run(task_id, snapshot):
        return run_episode(
            task_id, _model_for(task_id), env, {}, None, 20, {"mode": "test"}, snapshot, control=NO_MARKUP
        )

    selection = select_ood(list(OFFLINE_MEMORY), limit=40)
    results = str(tmp_path / "results.jsonl")
    assert run_ood(selection.task_ids, run, results, str(tmp_path)) == 80
    records = load_records(results)
    scores = score_with_bfcl(records, str(tmp_path / "bfcl"))
    for category in OFFLINE_MEMORY:
        ours = [r for r in records if r["category"] == category]
        passed = sum(r["valid"] for r in ours)
        assert 0 < passed < len(ours) == 40
        assert scores[category] == {"accuracy": passed / 40, "correct_count": passed, "total_count": 40}
        with open(score_file(str(tmp_path / "bfcl" / "score"), category)) as f:
            failing = {json.loads(line)["id"] for line in f.readlines()[1:]}
        assert failing == {r["task_id"] for r in ours if not r["valid"]}


# ---- skips, refusals, CLI ------------------------------------------------------------------------------------------


def test_vector_backend_is_skipped_without_its_embedding_model(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    reason = ood_tasks.unavailable_reason("memory_vector")
    assert reason and "all-MiniLM-L6-v2" in reason and str(tmp_path / "hf" / "hub") in reason
    assert select_ood(["memory_vector", "memory_kv"], limit=1).skipped == {"memory_vector": reason}
    with pytest.raises(EnvServiceError) as refused:
        env.create("memory_vector_0-customer-0", "validate")
    assert refused.value.status == 422 and "all-MiniLM-L6-v2" in str(refused.value)
    monkeypatch.setitem(ood_tasks.BACKEND_MODULES, "memory_vector", {})  # its packages aside: the model alone
    snapshot = tmp_path / "hf" / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in ("modules.json", "config.json"):
        (snapshot / name).write_text("{}")
    assert ood_tasks.unavailable_reason("memory_vector") is None  # found by its files, nothing imported


def test_web_search_is_skipped_without_a_key_and_runs_through_the_service_with_one(env, monkeypatch):
    monkeypatch.delenv(ood_tasks.SERPAPI_KEY_ENV, raising=False)
    reason = ood_tasks.unavailable_reason("web_search_base")
    assert reason and "SERPAPI_API_KEY" in reason
    assert select_ood(["web_search_no_snippet"]).task_ids == []
    with pytest.raises(EnvServiceError) as refused:
        env.create("web_search_base_0", "validate")
    assert refused.value.status == 422 and "SERPAPI_API_KEY" in str(refused.value)
    monkeypatch.setenv(ood_tasks.SERPAPI_KEY_ENV, "test-key-never-used")  # no call is made: no network
    assert len(select_ood(["web_search_no_snippet"]).task_ids) == 100
    created = env.create("web_search_no_snippet_3", "validate")
    system = created["messages"][0]["content"]
    assert system.startswith("For your final answer to the user") and '"name": "search_engine_query"' in system
    reply = env.step(created["instance_id"], "{'answer': 'I do not know', 'context': 'I do not know'}")
    assert reply["terminated"] and env.evaluate(created["instance_id"], release=True)["valid"] in (True, False)


def test_ood_tasks_are_refused_for_training(env, tmp_path):
    with pytest.raises(EnvServiceError) as refused:
        env.create("memory_kv_0-customer-0", "train")
    assert refused.value.status == 403 and refused.value.error == "evaluate_only"
    with pytest.raises(ValueError, match="evaluate-only"):
        OodEpisode(load_ood_task("memory_rec_sum_prereq_0-customer-0"), mode="train")
    with pytest.raises(EnvServiceError) as refused:  # multi-turn tasks take no memory
        env.create("multi_turn_base_0", "validate", memory_snapshot={"memory": "x"})
    assert refused.value.status == 400
    with pytest.raises(EnvServiceError) as refused:
        env.create("memory_rec_sum_0-customer-0", "validate", memory_snapshot={"memory": "x" * (1 << 20)})
    assert refused.value.status == 413

    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from seal.launch.preflight import _check_data

    rows = [
        {"prompt": [{"role": "user", "content": t}], "extra_info": {"task_id": t, "split": "train"}}
        for t in ("multi_turn_base_0", "memory_kv_0-customer-0")
    ]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = []
    _check_data(OmegaConf.create({"data": {"train_files": path, "val_files": []}}), problems)
    assert len(problems) == 1 and "memory_kv_0-customer-0" in problems[0] and "evaluate-only" in problems[0]


class _ScriptedChat(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint: stores nothing, answers every question with Michael."""

    calls = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        text = "{'answer': 'Michael', 'context': 'memory'}" if last.endswith("?") else "Noted."
        data = json.dumps({"choices": [{"message": {"content": text}}], "usage": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_cli_endpoint_runs_memory_and_skips_what_cannot_run(tmp_path, monkeypatch, capsys, tiny_dir):
    from seal.eval.__main__ import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    monkeypatch.delenv(ood_tasks.SERPAPI_KEY_ENV, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = str(tmp_path / "out")
    argv = ["endpoint", "--endpoint", f"http://127.0.0.1:{server.server_port}/v1", "--model", "scripted"]
    argv += ["--tokenizer", str(tiny_dir)]  # the environment's text is escaped of its control strings
    argv += ["--categories", "memory_kv,memory_vector,web_search_base", "--limit", "3", "--out", out, "--no-progress"]
    try:
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert "memory_vector skipped" in printed and "SERPAPI_API_KEY" in printed
        records = load_records(os.path.join(out, "results.jsonl"))
        assert sorted(r["task_id"] for r in records) == ood_task_ids("memory_kv")[:3]
        assert [r["valid"] for r in records if r["task_id"] == "memory_kv_0-customer-0"] == [True]
        with open(os.path.join(out, "table.json")) as f:
            table = json.load(f)
        assert table["ood_table"]["memory_kv"]["n"] == 3
        with open(os.path.join(out, "bfcl", "score.json")) as f:
            assert json.load(f)["memory_kv"]["correct_count"] == table["ood_table"]["memory_kv"]["passed"]
        assert os.path.exists(os.path.join(out, "memory_prereq", "memory_kv", "customer.json"))
        calls = _ScriptedChat.calls
        assert main(argv) == 0  # a rerun finds everything done: no model call at all
        assert _ScriptedChat.calls == calls and "3 already in" in capsys.readouterr().out
    finally:
        server.shutdown()


def test_memory_flows_over_http_through_worker_processes():
    """The production path: the HTTP service with episodes in worker processes; the chain's snapshot goes out of
    one prerequisite's evaluation and into the next episode's create request."""
    from env_service.client import EnvClient
    from env_service.episodes.manager import EpisodeManager
    from env_service.http.service import ServerThread

    with ServerThread(EpisodeManager(workers=1)) as server, EnvClient(server.url, retries=0, timeout_s=60) as http:
        snapshot = None
        for task_id in prereq_chain("memory_rec_sum", "notetaker")[:2]:
            iid = http.create(task_id, "validate", memory_snapshot=snapshot)["instance_id"]
            http.step(iid, _call("memory_append", text=f"from {task_id}. "))
            snapshot = http.evaluate(iid, release=True)["memory_snapshot"]
        assert snapshot == {
            "memory": "from memory_rec_sum_prereq_32-notetaker-0. from memory_rec_sum_prereq_33-notetaker-1. "
        }
        question = next(t for t in ood_task_ids("memory_rec_sum") if load_ood_task(t).scenario == "notetaker")
        created = http.create(question, "validate", memory_snapshot=snapshot)
        assert snapshot["memory"] in created["messages"][0]["content"]
        with pytest.raises(EnvServiceError) as refused:
            http.create(question, "train")
        assert refused.value.status == 403

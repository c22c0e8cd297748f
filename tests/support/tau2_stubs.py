"""Scripted OpenAI-compatible chat servers on loopback that play tau2's agent and user (no model, no network).

One HTTP server answers ``/v1/chat/completions`` for two model names. Both are stateless: each reply is derived
from the conversation the request carries, so a retry or a second run gets the same answer.

* ``stub-user`` (tau2's user simulator calls it): finds its task by the task's scenario text in the system
  prompt, opens with ``TASK <key>``, performs a user-side step (a tool call on the user's device, telecom) when
  the agent asks ``PLEASE STEP <i>``, answers ``DONE <i>`` after the tool result, and ends with tau2's
  ``###STOP###`` once the agent says ``ALL DONE``.
* ``stub-agent`` (tau2's ``llm_agent`` calls it, with tools): for a task scripted to ``pass``, walks the task's
  ground-truth actions in order -- its own as tool calls, the user's as ``PLEASE STEP <i>`` -- then says
  ``ALL DONE`` with the information the task wants communicated; for a task scripted to ``fail`` it does the
  first ``fail_after`` actions only; for ``silent`` it does every action but never says what it should have
  communicated.

``script``: {key: {"marker": scenario text, "mode": "pass"|"fail", "fail_after": int, "actions": [{"requestor",
"name", "arguments"}], "communicate": [str]}}; mode ``pass``, ``fail`` or ``silent``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AGENT_MODEL = "stub-agent"
USER_MODEL = "stub-user"


def _text(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def _tool_call(action: dict, index: int) -> dict:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": action["name"], "arguments": json.dumps(action["arguments"])},
    }


def agent_reply(script: dict, messages: list[dict]) -> dict:
    said = " ".join(_text(m) for m in messages if m.get("role") == "user")
    match = re.search(r"TASK (\S+)", said)
    if not match or match.group(1) not in script:
        return {"content": "How can I help you?"}
    task = script[match.group(1)]
    own_calls = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
    user_steps = sum(1 for m in messages if m.get("role") == "user" and _text(m).startswith("DONE "))
    step = own_calls + user_steps
    planned = task["actions"] if task["mode"] != "fail" else task["actions"][: task.get("fail_after", 0)]
    if step < len(planned):
        action = planned[step]
        if action["requestor"] == "assistant":
            return {"content": None, "tool_calls": [_tool_call(action, step)]}
        return {"content": f"PLEASE STEP {step}"}
    return {"content": "ALL DONE. " + " ".join(task["communicate"] if task["mode"] == "pass" else [])}


def user_reply(script: dict, messages: list[dict]) -> dict:
    system = " ".join(_text(m) for m in messages if m.get("role") == "system")
    found = [k for k, task in script.items() if task["marker"] in system]  # scenarios can extend one another
    key = max(found, key=lambda k: len(script[k]["marker"]), default=None)
    if key is None:
        return {"content": "###STOP###"}
    if not any(m.get("role") == "assistant" for m in messages):
        return {"content": f"TASK {key}"}
    last = messages[-1]
    agent_said = next((_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
    if "ALL DONE" in agent_said:
        return {"content": "###STOP###"}
    match = re.search(r"PLEASE STEP (\d+)", agent_said)
    if match:
        step = int(match.group(1))
        if last.get("role") == "tool":
            return {"content": f"DONE {step}"}
        return {"content": None, "tool_calls": [_tool_call(script[key]["actions"][step], step)]}
    return {"content": "Please go on."}


class StubServer:
    """The two stubs behind one loopback server; ``url`` is the OpenAI base URL; ``requests`` counts calls."""

    def __init__(self, script: dict):
        self.script = script
        self.requests = {AGENT_MODEL: 0, USER_MODEL: 0}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                model = body.get("model", "")
                reply_of = agent_reply if model == AGENT_MODEL else user_reply
                stub.requests[model if model in stub.requests else USER_MODEL] += 1
                message = {"role": "assistant", **reply_of(stub.script, body.get("messages", []))}
                data = json.dumps(
                    {
                        "id": "stub",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": model,
                        "choices": [
                            {
                                "index": 0,
                                "message": message,
                                "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

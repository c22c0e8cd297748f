"""An offline stand-in for a served model: an OpenAI-compatible chat endpoint on loopback with fixed replies.

The CPU rehearsal of the paper (``scripts/reproduce.py --rehearse``) runs the out-of-distribution evaluation against
it where a GPU run serves its checkpoint with vLLM: the same ``seal.eval endpoint`` command, environment service,
tau2 worker, records and tables, with a model that never calls a tool. As the agent it answers every message
with ``AGENT_REPLY``; as tau2's user simulator (any model name in ``USER_MODELS``) it ends the conversation at once
with tau2's stop token. No state: a retry gets the same reply.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AGENT_MODEL = "stub-agent"
USER_MODEL = "stub-user"
USER_MODELS = frozenset({USER_MODEL})
AGENT_REPLY = "I cannot help with that."
USER_STOP = "###STOP###"  # tau2's user-simulator token for the end of a conversation
MAX_BODY_BYTES = 8 << 20


def completion(model: str, text: str) -> dict:
    """A chat.completion response body with one assistant message."""
    return {
        "id": "stub",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        if not self.path.rstrip("/").endswith("/chat/completions") or not 0 < length <= MAX_BODY_BYTES:
            self.send_error(404 if length else 400)
            return
        model = json.loads(self.rfile.read(length)).get("model", AGENT_MODEL)
        data = json.dumps(completion(model, USER_STOP if model in USER_MODELS else AGENT_REPLY)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet: the evaluation prints its own progress
        pass


class StubEndpoint:
    """``with StubEndpoint() as stub: ... stub.url``: the OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""

    def __enter__(self) -> StubEndpoint:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

"""An offline stand-in for a served model: an OpenAI-compatible chat endpoint on loopback with fixed replies.

The CPU rehearsal of the paper (``scripts/reproduce.py --rehearse``) runs the out-of-distribution evaluation against
it where a GPU run serves its checkpoint with vLLM: the same ``seal.eval endpoint`` command, environment service,
tau2 worker, records and tables, with a model that never calls a tool. As the agent it answers every message
with ``AGENT_REPLY``; as tau2's user simulator (any model name in ``USER_MODELS``) it ends the conversation at once
with tau2's stop token. No state: a retry gets the same reply. ``GET /v1/models`` answers as a server that is up
does. ``python -m seal.eval.stub_endpoint --port N`` serves it in a process of its own (the serving tests).
"""

from __future__ import annotations

import argparse
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

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/v1/models":
            self.send_error(404)
            return
        data = json.dumps({"object": "list", "data": [{"id": AGENT_MODEL, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet: the evaluation prints its own progress
        pass


class StubEndpoint:
    """``with StubEndpoint() as stub: ... stub.url``: the OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, port: int = 0):
        self.port = port

    def __enter__(self) -> StubEndpoint:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="serve the stub chat endpoint on loopback until stopped")
    parser.add_argument("--port", type=int, required=True)
    with StubEndpoint(parser.parse_args().port) as stub:
        print(f"stub endpoint at {stub.url}", flush=True)
        threading.Event().wait()

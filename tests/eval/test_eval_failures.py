"""An evaluation whose episodes could not run: its tables are still written, the side that failed is named, and
the exit status says the results are incomplete; a selection that does not exist is one line, exit 2."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from seal.eval.__main__ import main
from seal.results.records import load_records

TASKS = "multi_turn_base_0,multi_turn_miss_func_0"


class _RefusingEndpoint(BaseHTTPRequestHandler):
    """A chat endpoint that answers every request with 401 (a wrong key): the model side cannot run."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"error": "invalid api key"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusingEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def endpoint_argv(endpoint: str, out, tokenizer) -> list[str]:
    """``tokenizer``: the served model's, whose control strings the environment's text is escaped of."""
    argv = ["endpoint", "--endpoint", endpoint, "--model", "m", "--tokenizer", str(tokenizer), "--ids", TASKS]
    return argv + ["--out", str(out), "--no-progress"]


def test_a_failing_model_endpoint_is_named_and_the_eval_fails(refusing_endpoint, tmp_path, capsys, tiny_dir):
    out = tmp_path / "eval"
    assert main(endpoint_argv(refusing_endpoint, out, tiny_dir)) == 1
    err = capsys.readouterr().err
    assert "2 episode(s) could not run" in err and "2 on the model endpoint" in err
    assert "environment service" not in err
    assert {r["failed_by"] for r in load_records(str(out / "results.jsonl"))} == {"model"}
    # every table is written, bfcl-eval's score included (nothing to score: empty)
    assert json.loads((out / "bfcl" / "score.json").read_text()) == {}
    assert json.loads((out / "table.json").read_text())["episodes"] == 2
    assert "2 on the model endpoint" in (out / "table.md").read_text()


def test_an_unreachable_environment_service_is_named_and_the_eval_fails(refusing_endpoint, tmp_path, capsys, tiny_dir):
    out = tmp_path / "eval"
    argv = endpoint_argv(refusing_endpoint, out, tiny_dir) + ["--env-url", f"http://127.0.0.1:{closed_port()}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 on the environment service" in err and "model endpoint" not in err
    assert (out / "table.md").exists() and (out / "bfcl" / "score.json").exists()


@pytest.mark.parametrize(
    "selection, says",
    [
        (["--ids", "multi_turn_base_99999"], "unknown task ids: ['multi_turn_base_99999']"),
        (["--category", "bogus"], "unknown category 'bogus'"),
    ],
)
def test_an_unknown_selection_is_one_line_and_exit_2(tmp_path, capsys, selection, says):
    argv = ["endpoint", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--out", str(tmp_path), *selection]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "model, says",
    [
        ("checkpoints/seal/SEAL/best/huggingface", "does not exist"),  # the docs' old, wrong path
        ("checkpoints/best", "does not exist"),  # two parts, like a hub id, but checkpoints/ is a folder here
        ("some-org/no-such-model", "nor in the Hugging Face cache"),  # a hub id, offline, not cached
    ],
)
def test_a_missing_checkpoint_is_refused_before_any_work_and_leaves_nothing(tmp_path, monkeypatch, capsys, model, says):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert main(["checkpoint", "--model", model, "--ids", "multi_turn_base_0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--model {model!r}" in err and says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # no eval_results/, nothing written

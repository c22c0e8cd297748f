"""The property-based fuzz of a model message's whole path (``benchmarks/fuzz_model_output.py``), bounded and
derandomized: generated messages under every tool-prompt mode through the real service over HTTP (one episode worker
process) and through the real ``BfclAgentLoop`` with the real tokenizer. No 5xx, valid text in every reply, every
episode evaluates, nothing out of the agent loop, no worker restart; and a broken reply check is caught.

The longer run is the command: ``python benchmarks/fuzz_model_output.py --examples 2000``.
"""

from __future__ import annotations

import pytest

import env_service.json_safe
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from tests.support.processes import repo_script

FUZZ = repo_script("benchmarks/fuzz_model_output.py")
SERVICE_EXAMPLES = 120
LOOP_EXAMPLES = 50


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager(workers=1)) as srv:
        yield srv


def test_generated_messages_never_answer_5xx_or_invalid_text(server):
    sent = FUZZ.fuzz_service(server.url, SERVICE_EXAMPLES)
    assert sent >= SERVICE_EXAMPLES  # every example stepped at least one message
    health = FUZZ.assert_service_healthy(server.url)
    assert health["created"] >= SERVICE_EXAMPLES and health["evaluations"] >= SERVICE_EXAMPLES


def test_generated_messages_never_escape_the_agent_loop(server, tokenizer):
    runs = FUZZ.fuzz_agent_loop(FUZZ.loop_config(server.url), tokenizer, LOOP_EXAMPLES)
    assert runs == LOOP_EXAMPLES
    FUZZ.assert_service_healthy(server.url)


def test_the_fuzz_catches_a_broken_reply_check(server, monkeypatch):
    """With the reply check off (``valid_text`` passes text through as it is), a lone surrogate a message names is
    echoed to the client, and the fuzz says so."""
    monkeypatch.setattr(env_service.json_safe, "valid_text", lambda text: text)
    with pytest.raises(AssertionError, match="not valid Unicode"):  # it stops at the first one it finds
        FUZZ.fuzz_service(server.url, 3 * SERVICE_EXAMPLES, seed=0, shrink=False)


def test_the_fuzz_catches_a_control_token_from_the_environment(server, tokenizer, monkeypatch):
    """With the agent loop's escape off (as before issue 38), generated messages that make the environment echo a
    control string (an unknown tool's name, a file's contents) put its token in the context, and the fuzz says so."""
    from env_service.control_text import ControlText

    monkeypatch.setattr("seal.agent_loop.control_text_of", lambda tokenizer: ControlText([]))
    with pytest.raises(AssertionError, match="control token from the environment"):
        FUZZ.fuzz_agent_loop(FUZZ.loop_config(server.url), tokenizer, 4 * LOOP_EXAMPLES, seed=0, shrink=False)

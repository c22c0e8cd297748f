"""One model output never crashes a step or answers 500, and Unicode in names means what the checker would say.

The three red-team cases of issue 34, each failing on the code before it: (1) a tool name written as a lone-surrogate
escape (``"\\ud800"``) was echoed back, decoded into a lone surrogate by the client and raised ``TypeError`` in the
agent loop's tokenizer, out of ``BfclAgentLoop.run``; (2) a lone surrogate in an OOD memory value made every
``evaluate`` of its episode 500; (3) deeply nested arguments given as a string passed the lenient parser's depth check
and answered 500 at ``evaluate``. Then the contracts behind them: every reply holds valid text whatever echoes it
(``env_service.json_safe``), every parser mode holds calls to one depth and encoding limit (``parser.call_problem``),
and the agent loop ends an episode whose reply it cannot use as a counted failure, never by raising.

The Unicode class of issue 31: look-alike, normalised-equal, zero-width and bidi-control tool names and argument names,
in every prompt mode. A name means what the checker means by it (``executor.py`` reproduces bfcl's reading): in JSON
calls a tool name matches code point for code point (bfcl looks it up as written), while argument names are read as
Python reads identifiers (NFKC), as bfcl's ``eval`` of the call string does; in a Python call list every identifier is
read as Python reads it, as bfcl's decoder does. The verifier replays exactly what the episode ran.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import requests

from env_service.bfcl.ood_episode import OodEpisode
from env_service.bfcl.ood_tasks import load_ood_task
from env_service.bfcl.parser import MAX_ARGUMENT_DEPTH
from env_service.client import EnvClient, EnvServiceError, InProcessEnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from env_service.json_safe import json_safe, sanitise
from tests.support.processes import repo_script

FUZZ = repo_script("benchmarks/fuzz_model_output.py")  # its scripted generation server and agent-loop runner
FS_TASK = "multi_turn_base_0"  # GorillaFileSystem + TwitterAPI
SHORT_TASK = "multi_turn_miss_func_121"  # TradingBot: a short first prompt for the agent loop
MEMORY_PREREQ = "memory_kv_prereq_32-notetaker-0"
SURROGATE_NAME_CALL = '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>'  # valid text, ASCII


def json_call(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def valid(value) -> bool:
    return FUZZ.invalid_text(value) is None


@pytest.fixture(scope="module")
def env():
    return InProcessEnvClient(EpisodeManager())


# ---- (1) a lone-surrogate tool name and the agent loop ------------------------------------------------------------


@pytest.fixture(scope="module")
def loop_config():
    return FUZZ.loop_config("inprocess", max_model_calls=1)


def test_a_lone_surrogate_tool_name_reaches_the_agent_loop_as_valid_text(loop_config, tokenizer):
    """Case 1: the reply names the tool as the model wrote it, escaped (``\\ud800`` as six characters); the loop
    tokenizes it into the context and the episode evaluates (before: ``TypeError`` out of ``run``)."""
    output = FUZZ.run_loop(loop_config, tokenizer, [SURROGATE_NAME_CALL], SHORT_TASK, "train")
    fields = output.extra_fields
    assert fields["seal_failed"] is False, fields["seal_error"]
    assert fields["seal_model_calls"] == 1 and fields["seal_tags"]
    assert len(fields["seal_env_errors"]) == 1 and "Tool '\\ud800'" in fields["seal_env_errors"][0]
    context = tokenizer.decode(output.response_ids)
    assert "Tool '\\ud800' call has text that is not valid Unicode" in context  # the context the model goes on from


def _reply(content="x", **changes) -> dict:
    return {
        "message": {"role": "user", "content": content},
        "terminated": False,
        "info": {"error_type": None},
        **changes,
    }


@pytest.mark.parametrize(
    "reply, reason",
    [
        (_reply("x \ud800"), "lone surrogate '\\ud800' at index 2"),
        (_reply(None), "reply message 0 has no text content"),
        (_reply(info={}), "no info.error_type"),
        (_reply(terminated="no"), "not the service's shape"),
        (_reply(extra_messages=[{"role": "user"}]), "reply message 1 has no text content"),
        (["not", "a", "reply"], "not the service's shape"),
    ],
)
def test_usable_reply_names_what_the_loop_cannot_use(reply, reason):
    from seal.agent_loop import UnusableEnvReply, usable_reply

    with pytest.raises(UnusableEnvReply, match=re.escape(reason)):
        usable_reply(reply)
    assert usable_reply(_reply(extra_messages=[{"role": "ipython", "content": "y"}]))[1]["content"] == "y"


@pytest.mark.parametrize("answer", [_reply("x \ud800"), KeyError("surprise")], ids=["unusable reply", "a bug"])
def test_a_reply_the_agent_loop_cannot_use_fails_only_its_episode(loop_config, tokenizer, answer):
    """Point 3: whatever the service answers (or a bug raises) while the loop handles a reply, ``run`` returns the
    episode as a counted failure with its reason, at once (no retry: the same reply would come back), and releases it.
    The service is real; only its step answer is replaced (the boundary under test)."""
    creates, releases = [], []

    def prepare(loop):
        from seal.env_clients import env_client

        env = env_client(loop.config.env_service)

        def create(*args, **kwargs):
            creates.append(args)
            return env.create(*args, **kwargs)

        def step(instance_id, content):
            if isinstance(answer, Exception):
                raise answer
            return answer

        def release(instance_id):
            releases.append(instance_id)
            return env.release(instance_id)

        loop.env = SimpleNamespace(create=create, step=step, release=release)
        loop.episode_retries = 2

    output = FUZZ.run_loop(loop_config, tokenizer, ["Done."], SHORT_TASK, "train", prepare=prepare)
    fields = output.extra_fields
    reason = "UnusableEnvReply: reply message 0 is not valid Unicode" if isinstance(answer, dict) else "KeyError"
    assert fields["seal_failed"] is True and fields["seal_error"].startswith(reason), fields["seal_error"]
    assert len(creates) == 1 and len(releases) == 1
    assert sum(output.response_mask) == 0 and output.reward_score == 0.0


# ---- (2) a lone surrogate in an OOD memory value ------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, '<tool_call>\n{"name": "core_memory_add", "arguments": {"key": "k", "value": "\\ud800"}}\n</tool_call>'),
        (
            {"strict_tool_parser": False},
            '<tool_call>\n{"name": "core_memory_add", "arguments": {"key": "k\\udfff", "value": "v"}}\n</tool_call>',
        ),
        ({"tool_prompt_mode": "toolace_llama"}, "[core_memory_add(key='k', value='\\ud800')]"),
    ],
)
def test_a_lone_surrogate_in_a_memory_value_never_makes_evaluate_500(env, params, message):
    """Case 2: the call is refused before it is kept (a lone surrogate is no text a snapshot can hold), so the
    prerequisite's evaluation (and its retry) answers with the memory it has, which the next episode takes."""
    assert message.encode("utf-8") and "\\ud" in message  # escapes in valid text, as a model writes them
    instance_id = env.create(MEMORY_PREREQ, "validate", params)["instance_id"]
    reply = env.step(instance_id, message)
    assert reply["info"]["num_calls"] == 0 and valid(reply)
    first = env.evaluate(instance_id)
    assert env.evaluate(instance_id, release=True) == first  # a retry answers the same, not 500
    assert first["error_type"] is None and first["memory_snapshot"] == {"core_memory": {}, "archival_memory": {}}
    following = MEMORY_PREREQ.replace("prereq_32", "prereq_33").replace("-0", "-1")
    env.release(env.create(following, "validate", memory_snapshot=first["memory_snapshot"])["instance_id"])


def test_a_flushed_snapshot_no_episode_could_load_is_a_verdict_not_a_500():
    """Whatever puts text into a backend's memory that no snapshot can hold, the prerequisite's evaluation hands back
    no snapshot and says why, instead of raising (before: ``UnicodeEncodeError``, answered 500)."""
    episode = OodEpisode(load_ood_task(MEMORY_PREREQ))
    episode.step(json_call("core_memory_add", {"key": "k", "value": "v"}))
    episode._session.instances["MemoryAPI_kv"].core_memory["k"] = "v\ud800"  # past every input check
    evaluation = episode.evaluate()
    assert evaluation["valid"] is None and evaluation["memory_snapshot"] is None
    assert evaluation["error_type"] == "memory_snapshot_invalid" and "lone surrogate" in evaluation["error_message"]
    assert valid(json_safe(evaluation))
    episode.close()


def test_a_memory_snapshot_that_is_not_valid_text_is_refused_at_create(env):
    with pytest.raises(EnvServiceError) as refused:
        env.create(MEMORY_PREREQ.replace("prereq_32", "prereq_33").replace("-0", "-1"), "validate",
                   memory_snapshot={"core_memory": {"k": "\udfff"}, "archival_memory": {}})  # fmt: skip
    assert refused.value.status == 400 and "not valid Unicode" in refused.value.message


# ---- (3) deeply nested arguments, whichever parser reads them -----------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


#: Every parser mode and the ways a call's arguments reach it; ``depth`` levels of containers in all (the arguments
#: object is level 1).
PARSER_MODES = {
    "strict, object": ({}, lambda depth: json_call("cd", {}).replace("{}", '{"folder": ' + _nested(depth - 1) + "}")),
    "strict, string": ({}, lambda depth: json_call("cd", '{"folder": ' + _nested(depth - 1) + "}")),
    "lenient, string": (
        {"strict_tool_parser": False},
        lambda depth: json_call("cd", '{"folder": ' + _nested(depth - 1) + "}"),
    ),
    "lenient, string, any tool": (
        {"strict_tool_parser": False, "enforce_available_tools": False},
        lambda depth: json_call("cd", '{"folder": ' + _nested(depth - 1) + "}"),
    ),
    "python": ({"tool_prompt_mode": "toolace_llama"}, lambda depth: f"[cd(folder={_nested(depth - 1)})]"),
}


@pytest.mark.parametrize("mode", ["lenient, string", "lenient, string, any tool", "strict, string"])
def test_deeply_nested_string_arguments_are_refused_before_they_are_kept(env, mode):
    """Case 3: 900 levels given as a string are refused at the step with the depth limit's text; nothing runs or is
    kept, and ``evaluate`` answers (before: the lenient parser let them through and evaluate answered 500)."""
    params, message = PARSER_MODES[mode]
    instance_id = env.create(FS_TASK, "train", params)["instance_id"]
    reply = env.step(instance_id, message(900))
    assert reply["info"]["num_calls"] == 0
    assert f"nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)" in reply["message"]["content"]
    assert env.evaluate(instance_id, release=True)["valid"] is False


@pytest.mark.parametrize("mode", list(PARSER_MODES))
def test_every_parser_mode_holds_calls_to_one_depth_limit(env, mode):
    params, message = PARSER_MODES[mode]
    runs, texts = [], []
    for depth in (MAX_ARGUMENT_DEPTH, MAX_ARGUMENT_DEPTH + 1, MAX_ARGUMENT_DEPTH + 2):
        instance_id = env.create(FS_TASK, "train", params)["instance_id"]
        reply = env.step(instance_id, message(depth))
        runs.append(reply["info"]["num_calls"])
        texts.append(reply["message"]["content"])
        env.evaluate(instance_id, release=True)
    assert runs == [1, 0, 0]  # at the limit the call runs (and fails in the backend); one level more, it never runs
    if params.get("strict_tool_parser", True):  # a strict parser says why, in the same words whatever the format
        assert all("nested too deeply (more than 32 levels)" in text for text in texts[1:]), texts


# ---- every reply holds valid text ----------------------------------------------------------------------------------


def test_json_safe_shows_lone_surrogates_as_their_escapes():
    reply = {"a\udc80": ["x\ud800y", {"k": "\udfff"}], "fine": "é😀\x00\u202e", "pair": "\U0001f600"}
    assert (
        json_safe(reply)
        == sanitise(reply)
        == {
            "a\\udc80": ["x\\ud800y", {"k": "\\udfff"}],
            "fine": "é😀\x00\u202e",  # every other code point stays: tokenizers and strict UTF-8 take them
            "pair": "\U0001f600",
        }
    )
    from env_service.json_safe import valid_text

    text = "ok"
    assert valid_text(text) is text


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager()) as srv:
        yield srv


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, SURROGATE_NAME_CALL),  # the parser's refusal quotes the name
        (FUZZ.FEEDBACK, SURROGATE_NAME_CALL),  # the train-only feedback around the error
        ({"tool_prompt_mode": "toolace_llama"}, "[cd(folder='\\udfff')]"),
    ],
)
def test_every_reply_that_echoes_a_lone_surrogate_is_valid_text_over_http(server, params, message):
    client = EnvClient(server.url, retries=0)
    instance_id = client.create(FS_TASK, "train", params)["instance_id"]
    response = requests.post(f"{server.url}/step", json={"instance_id": instance_id, "content": message}, timeout=30)
    assert response.status_code == 200
    reply = json.loads(response.content.decode("utf-8"))
    assert valid(reply), reply
    assert "\\ud" in reply["message"]["content"]  # the model sees what it wrote, as the escape
    assert valid(client.evaluate(instance_id, release=True))


def test_an_error_body_that_quotes_a_lone_surrogate_is_valid_text(server):
    response = requests.post(
        f"{server.url}/create", json={"task_id": FS_TASK, "mode": "train", "params": {"x\ud800": 1}}, timeout=30
    )
    assert response.status_code == 422
    body = json.loads(response.content.decode("utf-8"))
    assert valid(body) and "\\ud800" in body["detail"], body


# ---- Unicode in names (issue 31) -----------------------------------------------------------------------------------

#: Ways to write ``touch`` that are not ``touch`` code point for code point.
LOOK_ALIKES = {"cyrillic o": "t\u043euch", "combining accent": "to\u0301uch", "non-breaking space": "touch\u00a0"}
NORMALISED_EQUAL = {"fullwidth": "\uff54\uff4f\uff55\uff43\uff48", "mathematical bold": "\U0001d42d\U0001d428uch"}
INVISIBLE = {"zero-width joiner": "to\u200duch", "bidi override": "touch\u202e", "byte order mark": "\ufefftouch"}
JSON_MODES = {
    "strict": {},
    "lenient": {"strict_tool_parser": False},
    "strict, any tool": {"enforce_available_tools": False},
    "lenient, any tool": {"strict_tool_parser": False, "enforce_available_tools": False},
}
PYTHON_MODES = {
    "python": {"tool_prompt_mode": "toolace_llama"},
    "python, any tool": {"tool_prompt_mode": "toolace_llama", "enforce_available_tools": False},
    "python, lenient": {"tool_prompt_mode": "toolace_llama", "strict_tool_parser": False},
}


def _touch_and_look(env, params: dict, name: str, key: str = "file_name") -> tuple[dict, bool, dict]:
    """Call ``name(<key>='probe.txt')`` in the episode's format, then list the folder with the real ``ls``:
    (the call's reply, whether the file exists, the evaluation)."""
    python = params.get("tool_prompt_mode") == "toolace_llama"
    instance_id = env.create(FS_TASK, "validate", params)["instance_id"]
    call = f"[{name}({key}='probe.txt')]" if python else json_call(name, {key: "probe.txt"})
    reply = env.step(instance_id, call)
    listed = env.step(instance_id, "[ls()]" if python else json_call("ls", {}))
    evaluation = env.evaluate(instance_id, release=True)
    assert valid(reply) and valid(evaluation)
    return reply, "probe.txt" in listed["message"]["content"], evaluation


@pytest.fixture(scope="module")
def exact_name_run(env):
    """The evaluation of the plain ``touch`` call, to compare the verifier's replay of other spellings with."""
    return {mode: _touch_and_look(env, params, "touch")[2] for mode, params in {**JSON_MODES, **PYTHON_MODES}.items()}


@pytest.mark.parametrize("mode", list(JSON_MODES))
@pytest.mark.parametrize("spelling", [*LOOK_ALIKES, *NORMALISED_EQUAL, *INVISIBLE])
def test_a_json_tool_name_matches_code_point_for_code_point(env, exact_name_run, mode, spelling):
    """In a ``<tool_call>`` a tool name is looked up as written, as bfcl does: no other spelling of ``touch`` runs it,
    the step says why (not available, or bfcl's own error text), and the verifier labels the turn an invalid call."""
    name = {**LOOK_ALIKES, **NORMALISED_EQUAL, **INVISIBLE}[spelling]
    reply, ran, evaluation = _touch_and_look(env, JSON_MODES[mode], name)
    assert not ran
    assert reply["info"]["error_type"] is not None or "Error during execution" in reply["message"]["content"]
    assert evaluation["labels"][0] == "invalid_tool_call" != exact_name_run[mode]["labels"][0]


@pytest.mark.parametrize("mode", list(PYTHON_MODES))
@pytest.mark.parametrize("spelling", list(NORMALISED_EQUAL))
def test_a_python_call_name_is_read_as_python_reads_it(env, exact_name_run, mode, spelling):
    """In a Python call list an identifier is its NFKC form (Python's parser, and bfcl's decoder, read ``ｔｏｕｃｈ`` as
    ``touch``): the call runs ``touch``, and the verifier's replay runs the same, to the same verdict."""
    reply, ran, evaluation = _touch_and_look(env, PYTHON_MODES[mode], NORMALISED_EQUAL[spelling])
    assert ran and reply["info"]["num_calls"] == 1
    assert evaluation["tags"] == exact_name_run[mode]["tags"] and evaluation["labels"] == exact_name_run[mode]["labels"]


@pytest.mark.parametrize("mode", list(PYTHON_MODES))
@pytest.mark.parametrize("spelling", list(LOOK_ALIKES))
def test_a_python_look_alike_never_runs(env, mode, spelling):
    reply, ran, evaluation = _touch_and_look(env, PYTHON_MODES[mode], LOOK_ALIKES[spelling])
    assert not ran
    assert evaluation["labels"][0] in ("invalid_tool_call", "missing_tool_call")


@pytest.mark.parametrize("spelling", list(INVISIBLE))
def test_a_python_call_hidden_by_an_invisible_character_is_an_error_not_an_answer(env, spelling):
    """Strict: ``[to\\u200duch(...)]`` is a call attempt Python cannot read, so an error the model sees, as the same
    name is in a ``<tool_call>``; before, the strict parser took it for prose and ended the turn. Lenient: it ends
    the turn, as bfcl's decoder does with a reply it cannot decode."""
    reply, ran, evaluation = _touch_and_look(env, PYTHON_MODES["python"], INVISIBLE[spelling])
    assert not ran and reply["info"]["error_type"] == "parse_error"
    assert "invalid non-printable character" in reply["message"]["content"] and not reply["info"]["advanced"]
    lenient, ran, _ = _touch_and_look(env, PYTHON_MODES["python, lenient"], INVISIBLE[spelling])
    assert not ran and lenient["info"]["advanced"]


@pytest.mark.parametrize("params", [JSON_MODES["strict"], PYTHON_MODES["python"]], ids=["json", "python"])
def test_argument_names_are_read_as_bfcls_eval_reads_them(env, params):
    """An argument name NFKC-equal to ``file_name`` is ``file_name`` in both formats (bfcl ``eval``s the call string);
    a look-alike is an unknown argument."""
    _, ran, _ = _touch_and_look(env, params, "touch", key="\uff46ile_name")  # fullwidth f
    assert ran
    reply, ran, _ = _touch_and_look(env, params, "touch", key="file_n\u0430me")  # Cyrillic a
    assert not ran and "unexpected keyword argument" in reply["message"]["content"]

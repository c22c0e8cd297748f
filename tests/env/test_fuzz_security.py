"""Hostile and malformed assistant messages never run code, never crash the service, never 500.

More than 1,000 messages go through the in-process client under four env configs (the default; tool
availability NOT enforced, so hostile names reach the executor and the verifier; the lenient parser;
the Python-call-list prompt mode), and a sample goes over HTTP, plus raw invalid-UTF-8 bodies. Each
must get a normal reply or a clean 4xx. Episodes are evaluated too (the verifier re-executes accepted
calls). The payloads try to create a canary file, set a canary environment variable and plant a
canary builtins attribute; none of them may exist afterwards, and the service must still be healthy.
"""

from __future__ import annotations

import builtins
import json
import os
import random
import uuid

import pytest
import requests

from env_service.client import EnvClient, EnvServiceError, InProcessEnvClient
from env_service.episodes.manager import MAX_CONTENT_BYTES, EpisodeManager
from env_service.http.service import ServerThread

TOKEN = f"seal{uuid.uuid4().hex[:12]}"
CANARY_FILE = f"/tmp/{TOKEN}-canary"
CANARY_ENV = f"{TOKEN.upper()}_CANARY"
CANARY_ATTR = f"{TOKEN}_canary"

# Code that would leave a trace if anything evaluated it.
CODE = [
    f"__import__('os').system('touch {CANARY_FILE}')",
    f"open('{CANARY_FILE}', 'w').write('x')",
    f"__import__('os').environ.__setitem__('{CANARY_ENV}', '1')",
    f"setattr(__builtins__, '{CANARY_ATTR}', 1)",
    f"__import__('builtins').__setattr__('{CANARY_ATTR}', 1)",
    f"exec(\"open('{CANARY_FILE}','w')\")",
    f"eval(\"__import__('os').system('touch {CANARY_FILE}')\")",
    f"(lambda: __import__('os').system('touch {CANARY_FILE}'))()",
    f"[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{CANARY_FILE}'])",
    f"__import__('subprocess').run(['touch', '{CANARY_FILE}'])",
    f"compile(\"open('{CANARY_FILE}','w')\", 'x', 'exec')",
]

NAMES = CODE + [
    "ls.__class__",
    "ls.__globals__",
    "cd.__func__.__globals__['__builtins__']",
    "__class__",
    "__globals__",
    "__builtins__",
    "__import__",
    "os.system",
    "ls()",
    "ls(a=1)",
    "cd) or (ls",
    "ls; import os",
    "ls\n",
    "ls\x00",
    "",
    " ",
    "ls" * 5000,
    "mkdir.__self__",
    "self",
    "instance",
    "globals",
    "locals",
    "vars",
    "print",
    "open",
    "eval",
    "exec",
    "kill",
    "exit",
    "quit",
    "remove",
    "unlink",
    "popen",
    "Popen",
    "run",
    "f'{1}'",
    f'f"{{{CODE[0]}}}"',
    "lambda: 0",
    "_load_scenario",
    "__init__",
    "__eq__",
    "__dict__",
    "é",
    "ls\u202e",
    "\ud800x",
]

# Argument keys that would inject syntax into a "name(key=value)" call string.
KEYS = [
    f"folder={CODE[0]},x",
    f"x=1) or {CODE[0]} or (y",
    "**kwargs",
    "*args",
    "folder, **{}",
    "a.b",
    "a b",
    "",
    "1abc",
    "for",
    "None",
    "__class__",
    "folder\x00",
    "folder" * 2000,
    f"{{{CODE[1]}}}",
    "é",
    "fo\ud800",
]

# Argument values (all JSON): strings that look like code, quotes that would break naive quoting.
VALUES = [
    CODE[0],
    f"'); {CODE[0]}; ('",
    f'"); {CODE[1]}; ("',
    f"{{{CODE[2]}}}",
    "\\",
    "'",
    '"',
    "\x00",
    "\n" * 50,
    "a" * 100_000,
    -1,
    2**63,
    10**300,
    1e308,
    -0.0,
    True,
    None,
    [],
    {},
    [[[[]]]],
    {"__class__": CODE[3]},
    {"a": {"b": [CODE[4]]}},
    "ls(",
    "\u2028\u2029",
    "\udcff".encode("utf-8", "surrogateescape").decode("latin-1"),
]

TOOLS = ["ls", "cd", "mkdir", "touch", "echo", "cat", "post_tweet", "send_message", "get_stock_info", "logging"]


def _call(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _raw_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def _structural_payloads() -> list[str]:
    """Malformed shapes: wrong types, deep nesting, huge inputs, many blocks, odd numbers, bytes."""
    deep = "[" * 10_000 + "]" * 10_000
    return [
        _raw_call('{"name": "ls", "arguments": ' + deep + "}"),
        _raw_call('{"name": "cd", "arguments": {"folder": ' + "[" * 900 + "1" + "]" * 900 + "}}"),
        _raw_call('{"name": "cd", "arguments": {"folder": ' + "[" * 33 + "1" + "]" * 33 + "}}"),
        _raw_call('{"name": "cd", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"),
        deep,
        "{" * 100_000,
        "<tool_call>" * 20_000,
        "<tool_call>{" * 10_000,
        "<tool_call>\n" + "{" * 50_000 + "\n</tool_call>",
        _raw_call('{"name": "cd", "arguments": {"folder": NaN}}'),
        _raw_call('{"name": "cd", "arguments": {"folder": Infinity}}'),
        _raw_call('{"name": "cd", "arguments": {"folder": -Infinity}}'),
        _raw_call('{"name": "cd", "arguments": {"folder": 1e999}}'),
        _raw_call('{"name": "cd", "arguments": {"folder": ' + "9" * 5000 + "}}"),
        _raw_call('{"name": "cd", "arguments": {"folder": "a", "folder": "b"}}'),
        _raw_call('{"name": 1, "arguments": {}}'),
        _raw_call('{"name": null, "arguments": {}}'),
        _raw_call('{"name": ["ls"], "arguments": {}}'),
        _raw_call('{"name": {"x": 1}, "arguments": {}}'),
        _raw_call('{"name": "ls", "arguments": [1, 2]}'),
        _raw_call('{"name": "ls", "arguments": "{}"}'),
        _raw_call('{"name": "ls", "arguments": "not json"}'),
        _raw_call('{"name": "ls", "arguments": 3}'),
        _raw_call('{"name": "ls", "arguments": null}'),
        _raw_call('{"name": "ls"}'),
        _raw_call("{}"),
        _raw_call('["ls", {}]'),
        _raw_call('"ls"'),
        _raw_call("null"),
        _raw_call(""),
        "<tool_call></tool_call>",
        _raw_call('{"name": "ls", "parameters": {}}'),
        _raw_call('{"name": "ls", "arguments": {}} trailing'),
        "\n".join([_call("ls", {})] * 3000),
        "\n".join([_call("cd", {"folder": str(i)}) for i in range(300)]),
        "x" * (MAX_CONTENT_BYTES - 10),
        "x" * (MAX_CONTENT_BYTES + 1),
        "é" * (MAX_CONTENT_BYTES // 2 + 1),
        "\x00" * 1000,
        _call("ls\x00", {"a\x00": "\x00"}),
        "\ud800",
        "ok \udfff",
        _call("ls", {"x": "\ud83d"}),
        "",
        " ",
        "\n",
        "</tool_call>",
        "<tool_call>",
        "<TOOL_CALL>{}</TOOL_CALL>",
        # Python call lists (the toolace_llama prompt mode parses these with ast; must never evaluate)
        f"[cd(folder={CODE[0]})]",
        f"[{CODE[0]}]",
        f"[ls.__class__.__init__.__globals__['os'].system('touch {CANARY_FILE}')]",
        f"[(lambda: {CODE[0]})()]",
        f'[cd(folder=f"{{{CODE[0]}}}")]',
        f"[cd(**{{'folder': {CODE[1]}}})]",
        f"[cd(*[{CODE[0]}])]",
        f"[cd(folder=[x for x in [{CODE[0]}]])]",
        "[" * 10_000,
        "[" + "(" * 5000 + "]",
        f"[cd(folder='a' + {CODE[0]})]",
        f"[cd(folder=1 if {CODE[0]} else 2)]",
        "[cd(folder=__debug__)]",
        f"[cd(folder={{'a': {CODE[0]}}})]",
        "[ls()] " * 3000,
        "[cd(folder=b'x')]",
        "[cd(folder=...)]",
        f"[__import__('os').system('touch {CANARY_FILE}')]",
    ]


def hostile_messages(seed: int = 1234) -> list[str]:
    """The deterministic corpus (> 400 messages; run under four configs in-process)."""
    rng = random.Random(seed)
    messages = [_call(name, {}) for name in NAMES]
    messages += [_call(rng.choice(TOOLS), {key: "x"}) for key in KEYS]
    messages += [_call(rng.choice(TOOLS), {"folder": value, "file_name": value, "content": value}) for value in VALUES]
    # The same names / keys / values as Python call lists (what the toolace_llama mode parses).
    messages += [f"[{name}()]" for name in NAMES]
    messages += [f"[{rng.choice(TOOLS)}({key}='x')]" for key in KEYS]
    messages += [f"[{rng.choice(TOOLS)}(folder={value!r})]" for value in VALUES]
    messages += _structural_payloads()
    # Random mixtures: several blocks per message, hostile parts combined, text around them.
    for _ in range(150):
        parts = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.4:
                parts.append(_call(rng.choice(NAMES + TOOLS), {rng.choice(KEYS + ["folder"]): rng.choice(VALUES[:12])}))
            elif kind < 0.7:
                parts.append(_call(rng.choice(TOOLS), {"folder": rng.choice(CODE), rng.choice(KEYS): rng.choice(CODE)}))
            else:
                parts.append(rng.choice(CODE))
        messages.append(rng.choice(["", "Sure.\n", "<think>x</think>"]) + "\n".join(parts))
    return messages


CONFIGS = {
    "default": {},
    "no_enforce": {"enforce_available_tools": False},
    "lenient": {"strict_tool_parser": False, "enforce_available_tools": False},
    "python_calls": {"tool_prompt_mode": "toolace_llama", "enforce_available_tools": False},
}
TASKS = [
    "multi_turn_base_5",
    "multi_turn_long_context_7",
    "multi_turn_miss_func_10",
    "multi_turn_miss_param_8",
    "multi_turn_base_24",
    "multi_turn_long_context_1",
]


def assert_no_canary() -> None:
    assert not os.path.exists(CANARY_FILE), "a payload created the canary file: code was executed"
    assert CANARY_ENV not in os.environ, "a payload set the canary env var: code was executed"
    assert not hasattr(builtins, CANARY_ATTR), "a payload planted a builtins attribute: code was executed"


class Driver:
    """Feeds messages to episodes (new episode when one terminates), evaluating as it goes.

    Server-side failures (5xx) are collected, not raised, so one run lists every crashing payload.
    """

    def __init__(self, client, params: dict):
        self.client, self.params = client, params
        self.instance_id: str | None = None
        self.task_index = 0
        self.outcomes = {"ok": 0, "4xx": 0, "episodes": 0}
        self.failures: list[str] = []

    def _new_episode(self) -> None:
        task_id = TASKS[self.task_index % len(TASKS)]
        self.task_index += 1
        self.instance_id = self.client.create(task_id, "train", self.params)["instance_id"]
        self.outcomes["episodes"] += 1

    def _finish(self) -> None:
        try:
            evaluation = self.client.evaluate(self.instance_id)  # re-executes accepted hostile calls
            assert isinstance(evaluation["valid"], bool)
        except EnvServiceError as error:
            self.failures.append(f"evaluate -> {error.status}: {error.message}")
        assert self.client.release(self.instance_id)
        self.instance_id = None

    def send(self, message: str) -> None:
        if self.instance_id is None:
            self._new_episode()
        try:
            result = self.client.step(self.instance_id, message)
        except EnvServiceError as error:
            assert "Traceback" not in error.message
            if error.status is not None and 400 <= error.status < 500:
                self.outcomes["4xx"] += 1
                return
            self.failures.append(f"{ascii(message[:120])} -> {error.status}: {error.message}")
            self._finish()  # the episode may be inconsistent: evaluate (must not crash) and drop it
            return
        assert set(result) == {"message", "extra_messages", "terminated", "info"}
        assert isinstance(result["message"]["content"], str)
        self.outcomes["ok"] += 1
        if result["terminated"]:
            self._finish()

    def close(self) -> None:
        if self.instance_id is not None:
            self._finish()
        assert not self.failures, f"{len(self.failures)} server-side failures:\n" + "\n".join(self.failures)


@pytest.fixture(autouse=True)
def _canary_check():
    assert_no_canary()
    yield
    assert_no_canary()
    if os.path.exists(CANARY_FILE):  # pragma: no cover - only after a failure; keep /tmp clean
        os.remove(CANARY_FILE)


def test_corpus_is_big_enough():
    assert len(hostile_messages()) * len(CONFIGS) >= 1000


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_in_process_hostile_messages(config_name):
    manager = EpisodeManager()
    client = InProcessEnvClient(manager)
    driver = Driver(client, CONFIGS[config_name])
    messages = hostile_messages(seed=list(CONFIGS).index(config_name))
    for message in messages:
        driver.send(message)
    driver.close()
    stats = client.health()
    assert stats["episode_failures"] == 0
    assert stats["live"] == 0 and stats["created"] == stats["released"] == driver.outcomes["episodes"]
    assert driver.outcomes["ok"] + driver.outcomes["4xx"] + len(driver.failures) == len(messages)
    assert driver.outcomes["ok"] > driver.outcomes["4xx"]  # most are answered, not refused


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager()) as srv:
        yield srv


def test_http_hostile_sample(server):
    rng = random.Random(7)
    corpus = hostile_messages()
    # All structural payloads (the riskiest for a web stack) plus a random sample of the rest.
    sample = _structural_payloads() + rng.sample(corpus, 120)
    for params in (CONFIGS["no_enforce"], CONFIGS["python_calls"]):
        driver = Driver(EnvClient(server.url, retries=0), params)
        for message in sample:
            driver.send(message)
        driver.close()
    health = EnvClient(server.url).health()
    assert health["status"] == "ok" and health["episode_failures"] == 0 and health["live"] == 0


RAW_BODIES = [
    b'{"instance_id": "%s", "content": "\xff\xfe\xfd"}',
    b'{"instance_id": "%s", "content": "\xc3\x28"}',
    b'{"instance_id": "%s", "content": "\xed\xa0\x80"}',  # CESU-encoded surrogate
    b'{"instance_id": "%s", "content": "\xf4\x90\x80\x80"}',  # beyond U+10FFFF
    b'{"instance_id": "%s", "content": "a\x00b"}',  # raw NUL inside a JSON string (invalid JSON)
    b'{"instance_id": "%s", "content": "\\u0000"}',
    b'{"instance_id": "%s", "content": "\\ud800"}',
    b'{"instance_id": "%s", "content": NaN}',
    b'{"instance_id": "%s", "content": Infinity}',
    b'{"instance_id": "%s", "content": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    b'{"instance_id": "%s", "content": "x", "seq": 1e999}',
    b'{"instance_id": "%s", "content": "x", "seq": ' + b"9" * 5000 + b"}",
    b'\xef\xbb\xbf{"instance_id": "%s", "content": "bom"}',
    b'{"instance_id": "%s", "content": "x"' + b" " * 100_000 + b"}",
    b'{"instance_id": "%s", "content": "' + b"\\u00e9" * 60_000 + b'"}',
]


@pytest.mark.parametrize("index", range(len(RAW_BODIES)))
def test_http_raw_bytes_bodies(server, index):
    client = EnvClient(server.url, retries=0)
    failures_before = client.health()["episode_failures"]
    instance_id = client.create("multi_turn_base_5", "train", CONFIGS["no_enforce"])["instance_id"]
    body = RAW_BODIES[index].replace(b"%s", instance_id.encode(), 1)
    response = requests.post(f"{server.url}/step", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:300]
    assert "Traceback" not in response.text
    payload = response.json()
    assert ("message" in payload) if response.status_code == 200 else {"error", "detail"} <= set(payload)
    assert client.evaluate(instance_id)["valid"] in (True, False)
    assert client.release(instance_id)
    assert server.alive() and client.health()["episode_failures"] == failures_before

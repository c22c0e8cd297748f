"""Episodes against an OpenAI-compatible chat endpoint (text in, text out).

The environment service gives the messages (validate mode: no train-only interface); the endpoint's assistant
text goes back to ``step`` unchanged; the service's verdict is the result. Environment replies are sent as the
role the agent loop uses (``user``; a Llama-3.1 ``ipython`` result as ``tool``), with the served tokenizer's
control strings escaped exactly as the agent loop escapes them (``env_service/control_text.py``): the server
applies the chat template to what it is sent, so an unescaped ``<|im_end|>`` there would become the control token. Greedy (temperature 0) and the
validation episode limits: at most ``max_model_calls`` model calls per episode, ``max_tokens`` per call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import requests

from env_service.client import EnvServiceError, make_client
from env_service.control_text import ControlText
from seal.results.records import TurnLog, append_record, make_record


class EndpointError(RuntimeError):
    """The chat endpoint kept failing."""


class ContextExceeded(EndpointError):
    """The endpoint refused the request because the conversation no longer fits its context."""


@dataclass
class EndpointSettings:
    url: str
    model: str
    api_key: str | None = None
    max_tokens: int = 1024
    max_model_calls: int = 20
    timeout_s: float = 300.0
    retries: int = 3
    temperature: float = 0.0
    #: the served model's tokenizer (a folder, or a hub id in the local cache): its control strings are escaped in
    #: the environment's text before it is sent
    tokenizer: str | None = None

    @functools.cached_property
    def control_text(self) -> ControlText:
        return control_text_of(self.tokenizer)

    def chat_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/chat/completions") else f"{base}/chat/completions"


@functools.lru_cache(maxsize=4)
def control_text_of(tokenizer: str | None) -> ControlText:
    """The control strings of the tokenizer named ``tokenizer``; a clear error when it cannot be loaded."""
    from transformers import AutoTokenizer

    if not tokenizer:
        raise EndpointError("the endpoint's tokenizer is needed to escape control strings: name it with --tokenizer")
    try:
        return ControlText.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer))
    except (OSError, ValueError) as exc:
        raise EndpointError(
            f"cannot load the tokenizer {tokenizer!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); name "
            "the served model's tokenizer with --tokenizer (a folder, or a hub id in the local cache): its control "
            "strings are escaped in the environment's text before it is sent"
        ) from None


def chat(settings: EndpointSettings, messages: list[dict], session: requests.Session) -> tuple[str, dict]:
    """(assistant text, usage) of one greedy completion; bounded retries on connection errors and 5xx."""
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    body = {
        "model": settings.model,
        "messages": messages,
        "temperature": settings.temperature,
        "max_tokens": settings.max_tokens,
    }
    last = None
    for attempt in range(settings.retries + 1):
        try:
            response = session.post(settings.chat_url(), json=body, headers=headers, timeout=settings.timeout_s)
        except requests.RequestException as exc:
            last = exc
        else:
            if response.status_code == 400 and "context" in response.text.lower():
                raise ContextExceeded(response.text[:300])
            if response.status_code < 500 and response.status_code != 429:
                if not response.ok:
                    raise EndpointError(f"HTTP {response.status_code}: {response.text[:300]}")
                data = response.json()
                return data["choices"][0]["message"].get("content") or "", data.get("usage") or {}
            last = EndpointError(f"HTTP {response.status_code}: {response.text[:300]}")
        time.sleep(min(2.0**attempt, 10.0))
    raise EndpointError(f"{settings.chat_url()} failed after {settings.retries + 1} attempts: {last}")


#: A model: the conversation so far -> (assistant text, usage with ``prompt_tokens``/``completion_tokens``).
Generate = Callable[[list[dict]], tuple[str, dict]]


def run_episode(
    task_id: str,
    generate: Generate,
    env,
    env_params: dict,
    reward: dict | None,
    max_model_calls: int,
    source: dict,
    memory_snapshot: dict | None = None,
    *,
    control: ControlText,
) -> dict:
    """One validation episode of ``task_id`` with ``generate`` as the model; the record for the results file.
    ``memory_snapshot``: the memory an OOD memory episode starts from (``seal/eval/ood.py``); ``control``: the
    model's control strings, escaped in the environment's replies before they are sent."""
    tokens = {"prompt": 0, "completion": 0}
    log = TurnLog(env_params.get("tool_prompt_mode", "bfcl_qwen_fc"))
    calls, termination = 0, "completed"
    try:
        snapshot = {} if memory_snapshot is None else {"memory_snapshot": memory_snapshot}
        created = env.create(task_id, "validate", env_params, **snapshot)
    except EnvServiceError as exc:
        return make_record(
            task_id,
            None,
            [],
            model_calls=0,
            termination="env_error",
            tokens=tokens,
            source=source,
            failed=True,
            error=str(exc),
        )
    instance_id, messages = created["instance_id"], list(created["messages"])
    try:
        while True:
            if calls >= max_model_calls:
                termination = "max_model_calls"
                break
            try:
                text, usage = generate(messages)
            except ContextExceeded:
                termination = "context_budget"
                break
            calls += 1
            tokens["prompt"] += int(usage.get("prompt_tokens") or 0)
            tokens["completion"] += int(usage.get("completion_tokens") or 0)
            messages.append({"role": "assistant", "content": text})
            step = env.step(instance_id, text)
            log.add(text, step["message"], step["info"], step["terminated"])
            if step["terminated"]:
                break
            role = "tool" if step["message"].get("role") == "ipython" else "user"
            messages.append({"role": role, "content": control.escape(step["message"]["content"])})
        evaluation = env.evaluate(instance_id, reward, True)
    except (EnvServiceError, EndpointError) as exc:
        failed_by = "model" if isinstance(exc, EndpointError) else "environment"
        try:
            env.release(instance_id)
        except EnvServiceError:
            pass  # the service reclaims idle episodes anyway
        return make_record(
            task_id,
            None,
            log.as_list(),
            model_calls=calls,
            termination="error",
            tokens=tokens,
            source=source,
            failed=True,
            error=str(exc),
            failed_by=failed_by,
        )
    return make_record(
        task_id, evaluation, log.as_list(), model_calls=calls, termination=termination, tokens=tokens, source=source
    )


def run_endpoint(
    task_ids: list[str],
    settings: EndpointSettings,
    results_path: str,
    *,
    env_url: str | None = None,
    env_secret_file: str | None = None,
    env_params: dict | None = None,
    reward: dict | None = None,
    concurrency: int = 4,
    progress: bool = True,
) -> int:
    """Evaluate ``task_ids`` (the caller leaves out finished ones), appending a record as each finishes; returns
    the number of records written."""
    from tqdm import tqdm

    env, generate, source = _connect(settings, env_url, env_secret_file)
    env_params = env_params or {}
    written = 0
    with (
        ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool,
        tqdm(total=len(task_ids), desc=f"eval {settings.model}", disable=not progress, unit="task") as bar,
    ):
        futures = [
            pool.submit(
                run_episode,
                t,
                generate,
                env,
                env_params,
                reward,
                settings.max_model_calls,
                source,
                control=settings.control_text,
            )
            for t in task_ids
        ]
        for future in as_completed(futures):
            record = future.result()
            append_record(results_path, record)
            written += 1
            bar.set_postfix(passed=record["valid"], refresh=False)
            bar.update()
    return written


def _connect(settings: EndpointSettings, env_url: str | None, env_secret_file: str | None):
    """(environment client, the endpoint as a ``Generate``, the records' ``source``)."""
    from env_service.http.auth import resolve_secret

    env = make_client(env_url, retries=2, secret=resolve_secret(secret_file=env_secret_file))
    generate = functools.partial(chat, settings, session=requests.Session())
    return env, generate, {"mode": "endpoint", "endpoint": settings.url, "model": settings.model}


def run_endpoint_ood(
    task_ids: list[str],
    settings: EndpointSettings,
    results_path: str,
    out_dir: str,
    *,
    env_url: str | None = None,
    env_secret_file: str | None = None,
    env_params: dict | None = None,
    concurrency: int = 4,
    progress: bool = True,
) -> int:
    """The out-of-distribution questions ``task_ids`` against the endpoint (``seal/eval/ood.py``: memory scenarios'
    prerequisite conversations first); returns the number of records written."""
    from tqdm import tqdm

    from seal.eval.ood import run_ood

    env, generate, source = _connect(settings, env_url, env_secret_file)
    env_params = env_params or {}
    source = {**source, "tool_prompt_mode": env_params.get("tool_prompt_mode", "bfcl_qwen_fc")}

    def run(task_id: str, memory_snapshot: dict | None) -> dict:
        return run_episode(
            task_id,
            generate,
            env,
            env_params,
            None,
            settings.max_model_calls,
            source,
            memory_snapshot,
            control=settings.control_text,
        )

    with tqdm(total=len(task_ids), desc=f"ood {settings.model}", disable=not progress, unit="task") as bar:
        return run_ood(task_ids, run, results_path, out_dir, concurrency, source, on_record=lambda r: bar.update())

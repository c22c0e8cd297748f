"""The seal_bfcl agent loop on real CPU rollouts: token ids, loss masks, limits, diagnosis fields, failures.

The loop runs in-process against the real tiny model (``HFRolloutServer``, HF generate) and the real environment
(in-process client over the real episode manager); only verl's Ray plumbing around it is left out.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from env_service.client import EnvServiceError  # noqa: E402
from env_service.episodes.manager import EpisodeManager  # noqa: E402
from env_service.http.service import ServerThread  # noqa: E402
from seal.agent_loop import TRUNCATION_MARKER  # noqa: E402
from seal.cpu.hf_rollout import HFRolloutServer, HFServerConfig  # noqa: E402
from seal.env_clients import (
    NoServiceOnThisNode,  # noqa: E402
    env_client,  # noqa: E402
)
from seal.resume import SEED_FIELD  # noqa: E402
from tests.support.agent_loop import make_config, make_loop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK = "multi_turn_miss_func_121"  # a short-schema train task (see scripts/make_split.py)


class RecordingServer:
    """verl's server-manager interface over the real HF server, remembering every raw generation."""

    def __init__(self, server: HFRolloutServer):
        self.server = server
        self.generations: list[list[int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        out = await self.server.generate(prompt_ids=prompt_ids, sampling_params=sampling_params, request_id=request_id)
        self.generations.append(list(out.token_ids))
        return out


def run_episode(config, tokenizer, server, split="train", temperature=1.0, task=TASK, prepare=None, fields=None):
    """Build the loop inside the event loop that runs it (verl's AgentLoopBase binds to the running loop)."""
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": True}
    extra = {"task_id": task, "split": split, "category": task.split("_", 2)[2].rsplit("_", 1)[0]}

    async def go():
        loop = make_loop(config, tokenizer, server)
        if prepare:
            prepare(loop)
        return await loop.run(params, extra_info=extra, raw_prompt=[], **(fields or {}))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def rollout(tiny_dir, tokenizer):
    config = make_config()
    server = RecordingServer(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=256)))
    output = run_episode(config, tokenizer, server)
    return config, server, output


def masked_segments(ids, mask, value):
    segments, current = [], []
    for token, m in zip(ids, mask):
        if m == value:
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    return segments


def test_trained_tokens_are_exactly_the_model_generations(rollout, tokenizer):
    config, server, out = rollout
    trained = [t for t, m in zip(out.response_ids, out.response_mask) if m == 1]
    generated = [t for g in server.generations for t in g]
    # the response is cut at response_length, so the trained tokens are a prefix of everything generated
    assert trained == generated[: len(trained)]
    assert len(trained) > 0
    assert tokenizer.decode(trained) == tokenizer.decode(generated[: len(trained)])


def test_environment_and_template_tokens_are_never_trained(rollout, tokenizer):
    _, server, out = rollout
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first_generation = server.generations[0]
    assert first_generation[-1] != eos  # the random tiny model is cut by the length limit ...
    position = len(first_generation)
    # ... so the loop closed that turn with an inserted <|im_end|> that carries mask 0
    assert out.response_ids[position] == eos and out.response_mask[position] == 0
    for segment in masked_segments(out.response_ids, out.response_mask, 0):
        text = tokenizer.decode(segment)
        # every untrained stretch is chat-template framing and/or an environment message, never model text
        assert (
            text.startswith("<|im_end|>")
            or text.startswith("\n<|im_start|>user")
            or text.startswith("<|im_start|>user")
        )


def test_environment_messages_appear_as_user_turns(rollout, tokenizer):
    _, server, out = rollout
    untrained = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    # the tiny model emits no tool calls, so the environment answers with the next user question
    assert "<|im_start|>user\n" in untrained
    assert "<|im_start|>assistant\n" in untrained


def test_output_carries_reward_and_diagnosis(rollout):
    config, server, out = rollout
    fields = out.extra_fields
    assert out.reward_score == 0.0  # a random model does not solve a BFCL task
    assert fields["seal_task_id"] == TASK and fields["seal_category"] == "miss_func"
    assert fields["seal_failed"] is False
    assert len(fields["seal_tags"]) == len(fields["seal_labels"]) > 0
    assert fields["seal_model_calls"] == len(server.generations) == out.num_turns
    assert fields["seal_termination"] in {"completed", "context_budget", "max_model_calls"}
    assert "progress" in fields["reward_extra_info"]
    assert len(out.response_ids) <= config.actor_rollout_ref.rollout.response_length


def test_model_call_limit_is_enforced(tiny_dir, tokenizer):
    config = make_config(**{"seal.rollout.max_model_calls": 1})
    server = RecordingServer(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=256)))
    out = run_episode(config, tokenizer, server)
    assert len(server.generations) == 1
    assert out.extra_fields["seal_termination"] == "max_model_calls"


def test_context_budget_stops_the_episode(tiny_dir, tokenizer, rollout):
    """Before each call the context must stay below max_model_len - response_length (the released recipe's rule)."""
    prompt_len = len(rollout[2].prompt_ids)
    config = make_config(**{"actor_rollout_ref.rollout.max_model_len": prompt_len + 256 + 10})
    server = RecordingServer(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=256)))
    out = run_episode(config, tokenizer, server)
    # room for exactly one call: its 24 tokens plus the environment's reply exceed the 10 spare tokens
    assert len(server.generations) == 1
    assert out.extra_fields["seal_termination"] == "context_budget"


def test_over_long_first_prompt_is_a_failed_episode_not_a_crash(tiny_dir, tokenizer, rollout):
    config = make_config(**{"actor_rollout_ref.rollout.prompt_length": 512, "seal.rollout.episode_retries": 2})
    server = RecordingServer(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=256)))
    out = run_episode(config, tokenizer, server)
    assert server.generations == []
    assert out.extra_fields["seal_failed"] is True
    assert "raise data.max_prompt_length" in out.extra_fields["seal_error"]
    assert sum(out.response_mask) == 0 and out.reward_score == 0.0
    assert out.extra_fields["seal_failure_kind"] == "task_data"  # the task's prompt, not the environment
    assert out.extra_fields["reward_extra_info"]["episode_failed"] == 1.0
    # verl joins the workers' chunks only when every trajectory has the same keys and log-probs
    completed = rollout[2]
    assert set(out.extra_fields) == set(completed.extra_fields)
    assert set(out.extra_fields["reward_extra_info"]) == set(completed.extra_fields["reward_extra_info"])
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)


def test_every_trajectory_has_log_probs_for_each_response_token(rollout):
    out = rollout[2]
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)
    trained = [lp for lp, m in zip(out.response_logprobs, out.response_mask) if m == 1]
    assert all(lp <= 0.0 for lp in trained) and any(lp < 0.0 for lp in trained)


def test_length_cut_and_zero_call_episodes_have_the_same_keys(tiny_dir, tokenizer, rollout):
    """An episode stopped before its first generation (context budget) still has every key and log-probs."""
    prompt_len = len(rollout[2].prompt_ids)
    config = make_config(**{"actor_rollout_ref.rollout.max_model_len": prompt_len + 256})
    server = RecordingServer(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=256)))
    out = run_episode(config, tokenizer, server)
    assert server.generations == [] and out.extra_fields["seal_termination"] == "context_budget"
    assert set(out.extra_fields) == set(rollout[2].extra_fields)
    assert out.response_logprobs is not None and len(out.response_logprobs) == len(out.response_ids)


def test_unknown_end_of_turn_token_is_a_clear_error(tokenizer):
    from seal.agent_loop import end_of_turn_id

    assert end_of_turn_id(tokenizer, "<|im_end|>") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="end_of_turn_token"):
        end_of_turn_id(tokenizer, "<|eot_id|>")


def test_long_environment_messages_are_clipped(tiny_dir, tokenizer):
    async def build():
        return make_loop(make_config(), tokenizer, RecordingServer(None))

    loop = asyncio.run(build())
    text = "word " * 2000
    clipped = loop._clip_env_text(text)
    assert clipped.endswith(TRUNCATION_MARKER)
    assert len(tokenizer.encode(clipped, add_special_tokens=False)) <= loop.max_env_tokens + 2
    assert loop._clip_env_text("short") == "short"


def test_validation_episodes_use_the_original_interface(tiny_dir, tokenizer):
    """A validate-mode rollout must see the untouched prompt even though the recipe turns schema cues on."""
    config = make_config(**{"seal.rollout.max_model_calls": 1})
    seen = {}

    class Capture(RecordingServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            seen.setdefault("prompt", tokenizer.decode(prompt_ids))
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    server = Capture(HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=4096, response_length=8)))
    run_episode(config, tokenizer, server, split="val", temperature=0)
    assert "[required]" not in seen["prompt"] and "Observation note" not in seen["prompt"]
    seen.clear()
    run_episode(config, tokenizer, server, split="train")
    assert "[required]" in seen["prompt"] and "Observation note" in seen["prompt"]


def test_failing_environment_gives_a_failed_episode_kept_out_of_the_loss(tiny_dir, tokenizer, monkeypatch):
    config = make_config(**{"seal.rollout.episode_retries": 1})
    calls = []

    def broken_create(*args, **kwargs):
        calls.append(args)
        raise EnvServiceError(503, "service unavailable", "http_error")

    out = run_episode(
        config,
        tokenizer,
        RecordingServer(None),
        prepare=lambda loop: monkeypatch.setattr(env_client(loop.config.env_service), "create", broken_create),
    )
    assert len(calls) == 2  # first try + one retry, then give up
    assert out.extra_fields["seal_failed"] is True and "service unavailable" in out.extra_fields["seal_error"]
    assert out.extra_fields["seal_failure_kind"] == "environment"
    assert sum(out.response_mask) == 0 and out.reward_score == 0.0


def test_a_seeded_sample_draws_the_same_in_any_run_and_another_seed_draws_anew(rollout, tokenizer):
    """The seed the step gives a training sample reaches every model call: the same seed draws the same tokens
    whatever the server drew before (a resumed step is not the server's first draws again), another seed draws
    others."""
    config = make_config(**{"seal.rollout.max_model_calls": 1})  # one call is enough to see the draws

    def generations(seed):
        server = RecordingServer(rollout[1].server)  # the same server, its own random stream moving on
        run_episode(config, tokenizer, server, fields={SEED_FIELD: seed})
        return server.generations

    first = generations(7)
    assert generations(7) == first
    assert generations(8) != first


def test_a_retried_episode_draws_afresh_and_the_same_in_a_rerun(rollout, tokenizer, monkeypatch):
    """The environment fails the first attempt's step; the retry samples with a seed of its attempt: other tokens
    than the attempt that failed (the same seed would replay them), and the same tokens when the run is rerun."""
    config = make_config(**{"seal.rollout.max_model_calls": 1, "seal.rollout.episode_retries": 1})

    def generations():
        server = RecordingServer(rollout[1].server)
        failed = []

        def fail_first_step(loop):
            env = env_client(loop.config.env_service)  # the process's client, which every loop shares
            step = type(env).step  # the client's own

            def flaky(*args):
                if not failed:
                    failed.append(args)
                    raise EnvServiceError(503, "service unavailable", "http_error")
                return step(env, *args)

            monkeypatch.setattr(env, "step", flaky)

        out = run_episode(config, tokenizer, server, prepare=fail_first_step, fields={SEED_FIELD: 7})
        assert failed and not out.extra_fields["seal_failed"]  # the first attempt failed, the retry completed
        return server.generations

    first_attempt, retry = generations()
    assert retry != first_attempt
    assert generations() == [first_attempt, retry]


@pytest.mark.parametrize(
    "lookup_error",
    [NoServiceOnThisNode("no environment service runs on Ray node N"), RuntimeError("RayActorError: the actor died")],
)
def test_a_node_without_its_service_fails_the_episode_as_the_environments(tokenizer, monkeypatch, lookup_error):
    """The node's service is looked up in the episode (on the env-call threads, not the worker's event loop): a
    loop is still built, and the missing service fails that episode, with its kind, instead of the worker's chunk."""
    from seal import env_clients

    def no_service(env_cfg):
        raise lookup_error

    monkeypatch.setattr(env_clients, "service_for_this_node", no_service)
    env_clients._CLIENTS.clear()
    out = run_episode(make_config(**{"env_service.url": "http://127.0.0.1:9"}), tokenizer, RecordingServer(None))
    env_clients._CLIENTS.clear()
    fields = out.extra_fields
    assert fields["seal_failed"] is True and fields["seal_failure_kind"] == "environment", fields["seal_error"]
    assert str(lookup_error) in fields["seal_error"]
    assert sum(out.response_mask) == 0 and out.reward_score == 0.0


def test_the_env_clients_pool_holds_a_connection_for_every_env_call_thread():
    """Every env-call thread can hold a kept-alive connection at once (a smaller pool opens and drops a new one for
    each call beyond it, under the recipe's 256 episodes a step)."""
    from seal import env_clients

    env_clients._CLIENTS.clear()
    client = env_client(make_config(**{"env_service.url": "http://127.0.0.1:9"}).env_service)
    env_clients._CLIENTS.clear()
    pool = client.session.get_adapter("http://127.0.0.1:9").poolmanager.connection_pool_kw
    assert pool["maxsize"] >= env_clients.ENV_CALL_THREADS


class QueuedServer(RecordingServer):
    """Every generation first waits ``queued_s``, as one queued behind a step's other requests in vLLM does."""

    def __init__(self, server: HFRolloutServer, queued_s: float):
        super().__init__(server)
        self.queued_s = queued_s

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(self.queued_s)
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def test_an_episode_whose_generations_wait_past_the_idle_limit_is_not_reclaimed(tiny_dir, tokenizer, rollout):
    """The service reclaims episodes idle for ``idle_timeout_s`` (here 1 s, every 0.1 s) — for clients that are gone.
    An episode whose every generation waits 2.5 s in the queue is still in use: it keeps its episode (touched while
    it waits), finishes in its first attempt, and the service reclaims nothing."""
    _, recorded, _ = rollout
    manager = EpisodeManager(idle_timeout_s=1.0, reclaim_interval_s=0.1)
    with ServerThread(manager) as service:
        config = make_config(**{"env_service.url": service.url, "seal.rollout.max_model_calls": 2})
        out = run_episode(config, tokenizer, QueuedServer(recorded.server, queued_s=2.5))
        stats = manager.stats()
    assert not out.extra_fields["seal_failed"], out.extra_fields["seal_error"]
    assert out.extra_fields["seal_termination"] in ("max_model_calls", "completed"), out.extra_fields
    assert stats["reclaimed"] == 0 and stats["created"] == 1, stats

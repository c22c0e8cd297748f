"""The agent loop records an environment reply as an error exactly when the service says it is one (the step's
``info["error_type"]``), not when the reply's text happens to contain an error marker.

The model is scripted (fixed replies, as token ids); the loop, the environment service (in-process) and the BFCL
backends are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from seal.agent_loop import BfclAgentLoop  # noqa: E402
from seal.cpu.scripted_rollout import FixedReplies  # noqa: E402
from seal.launch.recipe import compose_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK = "multi_turn_base_0"  # GorillaFileSystem + TwitterAPI


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_env_errors_follow_the_structured_error_type(tokenizer):
    replies = [
        call("touch", file_name="notes.txt") + call("echo", content="[ERROR] is only text here", file_name="notes.txt"),
        call("cat", file_name="notes.txt"),  # a clean result whose text carries an error marker
        call("cd", folder="missing"),  # an error result without any marker: {"error": "cd: missing: ..."}
    ]
    config = compose_recipe(
        str(REPO / "exp" / "cpu_tiny.yaml"),
        [
            "env_service.url=inprocess",
            f"seal.rollout.max_model_calls={len(replies)}",
            "data.max_prompt_length=8192",  # this task's tool schemas are long
            "actor_rollout_ref.rollout.max_model_len=9000",
        ],
    )
    OmegaConf.resolve(config)

    async def go():
        loop = BfclAgentLoop.outside_workers(config, tokenizer, FixedReplies(tokenizer, replies), hf_model_type="qwen2")
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        return await loop.run(params, extra_info={"task_id": TASK, "split": "validate"}, raw_prompt=[])

    output = asyncio.run(go())
    errors = output.extra_fields["seal_env_errors"]
    assert len(errors) == 1, errors
    assert '"error"' in errors[0] and "No such file or directory" in errors[0]
    assert output.extra_fields["seal_model_calls"] == len(replies)


def test_a_workers_episodes_wait_on_the_service_together_whatever_the_cores():
    """Env calls run on the agent loop's own threads: a worker's share of validation (50 episodes) can all be waiting
    on the service at once, where the default executor (6 threads on 2 cores) would queue all but 6 of them."""
    import threading

    from seal.agent_loop import env_call

    waiting = 50
    barrier = threading.Barrier(waiting, timeout=10)

    async def all_at_once():
        return await asyncio.gather(*(env_call(barrier.wait) for _ in range(waiting)))

    assert sorted(asyncio.run(all_at_once())) == list(range(waiting))  # a broken barrier raises instead

"""The CPU time an episode's messages use is budgeted over the whole episode, not only per call and per
message. Against a real service with a worker process: an episode that keeps sending messages whose calls each stay
within their own budgets ends once its messages used ``episode_cpu_budget_s`` together."""

from __future__ import annotations

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from tests.support.env_attacks import aliasing_messages, call

LIMITS = ServiceLimits(call_budget_s=0.1, message_budget_s=0.25, episode_cpu_budget_s=1.0, max_steps=100)


def test_an_episodes_many_cheap_calls_end_it_at_its_cpu_budget():
    """Each ``find`` runs to its 0.1 s call budget, within the message's; before, such messages went on for
    ``max_steps`` messages (up to 100 x the message budget of one worker's time)."""
    with ServerThread(EpisodeManager(workers=1, limits=LIMITS)) as server, EnvClient(server.url, retries=0) as client:
        instance_id = client.create("multi_turn_base_0", "validate")["instance_id"]
        for message in aliasing_messages():  # after these, each find runs to its budget
            client.step(instance_id, message)
        replies = []
        while not replies or not replies[-1]["terminated"]:
            replies.append(client.step(instance_id, call("find", path=".") * 2))
            assert len(replies) < 40, "the episode did not end"
        # ~0.2 s of CPU a message: the budget ends it after ~5 (a loaded machine gives each call less CPU)
        assert len(replies) <= LIMITS.episode_cpu_budget_s / LIMITS.call_budget_s + 1, len(replies)
        last = replies[-1]
        assert last["info"]["error_type"] == "limit_exceeded" and "CPU time budget of 1 s" in last["message"]["content"]
        assert all(r["info"]["error_type"] == "budget_exceeded" for r in replies[:-1])  # each call at its own budget
        assert client.evaluate(instance_id, release=True)["valid"] is False

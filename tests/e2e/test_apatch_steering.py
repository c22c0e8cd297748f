"""The A-Patch steering check (``scripts/learning_check.py --apatch-steering``, docs/learning-check.md) without a
training run: its decoys get the tags and scales it relies on from a real service, its statistics, and its verdict
sees a broken tag -> scale -> advantage link.

The broken-link test drives the verdict with the real SEAL step (``SealTrainer._seal_step``: diagnosis, the closed
loop, A-Patch, on batches of the tags the service gives the three options, GRPO advantages by verl) and, in place of
the tiny model, a softmax over the three options updated by those advantages: what A-Patch changes in the real run
is how hard each failing choice is pushed down, and that is what this keeps. A few seconds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from env_service.bfcl.config import EnvConfig
from env_service.bfcl.tasks import load_task
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from seal.cpu.warm_start import episode_texts
from seal.launch.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import learning_check  # noqa: E402

from seal.report import decoy_choice  # noqa: E402
from tests.support.trainer_step import make_batch, make_trainer  # noqa: E402

RECIPE = learning_check.STEERING_RECIPES["on"]


@pytest.fixture(scope="module")
def choice():
    return decoy_choice.FirstChoice(RECIPE)


@pytest.fixture(scope="module")
def options(choice):
    return choice.options()


def test_the_decoys_get_their_tags_from_the_service_and_differ_in_scale(options):
    config = compose_recipe(str(REPO / RECIPE))
    ((task_id, (old, light, heavy)),) = decoy_choice.recipe_decoys(RECIPE).items()
    task = load_task(task_id)
    env_params = OmegaConf.to_container(config.env_service.bfcl, resolve=True)
    mode = EnvConfig.from_dict(env_params).tool_prompt_mode
    expected = {  # what the verifier's progress tags say of each first message (docs/learning-check.md)
        "right": (None, ["pass", "pass"]),
        "light": ((old, light), ["response_mismatch", "pass"]),  # a wrong symbol: read-only, turn 2 unaffected
        "heavy": ((old, heavy), ["state_mismatch", "state_mismatch"]),  # a spurious fund_account: state differs
    }
    with ServerThread(EpisodeManager(max_episodes=8)) as server, EnvClient(server.url, retries=0) as client:
        for name, (decoy, tags) in expected.items():
            texts = episode_texts(task, mode, decoy)
            instance = client.create(task_id, "train", env_params)["instance_id"]
            for text in texts:
                if client.step(instance, text)["terminated"]:
                    break
            served = client.evaluate(instance, release=True)["tags"]
            assert served == tags == options[name]["tags"], name
            assert options[name]["text"] == texts[0]
    # the recipe's weights: state_mismatch 2.0, response_mismatch 0.5, pass 1.0 (mean over the episode's turns)
    assert options["heavy"]["scale"] == 2.0 and options["light"]["scale"] == 0.75 and options["right"]["scale"] == 1.0


def test_episodes_are_classified_by_the_tags_their_first_message_earns(options, choice):
    reply = "\nuser\n<tool_response>\n{}\n</tool_response>\n\nassistant\nDone.\nuser\nAdditionally"
    for name, option in options.items():
        assert decoy_choice.first_message(option["text"] + reply) == option["text"]
        assert learning_check.option_of(option["text"] + reply, options, choice) == name
    # the spurious deposit alone earns the heavy decoy's tags; a second, read-only call after the right one does not
    # change the right one's; a broken call and nothing at all are none of the options
    deposit = '<tool_call>\n{"name": "fund_account", "arguments": {"amount": 10}}\n</tool_call>'
    assert learning_check.option_of(deposit + reply, options, choice) == "heavy"
    again = options["right"]["text"] + "\n" + options["right"]["text"]
    assert learning_check.option_of(again + reply, options, choice) == "right"
    assert learning_check.option_of(options["right"]["text"][:-3] + reply, options, choice) == "other"
    assert learning_check.option_of("", options, choice) == "other"


def test_the_log_ratio_change_and_the_paired_rule():
    def run(first: tuple[int, int], later: tuple[int, int]) -> dict:
        steps = [first] + [later] * 9  # (heavy, light) per step
        return {
            s + 1: {"right": 16 - heavy - light, "heavy": heavy, "light": light, "other": 0}
            for s, (heavy, light) in enumerate(steps)
        }

    falls = run((5, 5), (1, 3))  # the heavy decoy is unlearnt faster than the light one
    assert learning_check.log_ratio_change(falls) == pytest.approx(math.log(9.5 / 27.5) - math.log(5.5 / 5.5))
    flat = run((5, 5), (2, 2))
    assert learning_check.log_ratio_change(flat) == pytest.approx(0.0)
    steered = {seed: {"on": falls, "off": flat} for seed in (1, 2, 3)}
    steered[3]["off"] = run((5, 5), (3, 2))  # some spread across seeds, so the standard error is not 0
    assert learning_check.steering_verdict(steered, 2.0)["passed"]
    reversed_ = {seed: {"on": runs["off"], "off": runs["on"]} for seed, runs in steered.items()}
    assert not learning_check.steering_verdict(reversed_, 2.0)["passed"]  # the light decoy falling is no pass
    assert learning_check.steering_verdict({1: steered[1]}, 2.0)["passed"] is None  # one seed: no verdict


OPTIONS = ("right", "heavy", "light")


def simulated_run(trainer, options: dict, seed: int, steps: int = 10, n: int = 16, lr: float = 0.5) -> dict:
    """Per-step option counts of a softmax policy over the three first messages, trained by the advantages the SEAL
    step leaves in the batch (GRPO over one group of ``n``, the tags the service gives each option)."""
    logits = torch.zeros(len(OPTIONS), dtype=torch.float64)  # the warm start: the three equally likely
    generator = torch.Generator().manual_seed(seed)
    counts = {}
    for step in range(1, steps + 1):
        probs = torch.softmax(logits, 0)
        chosen = torch.multinomial(probs, n, replacement=True, generator=generator).tolist()
        rows = [("0", float(OPTIONS[c] == "right"), options[OPTIONS[c]]["tags"], [], False) for c in chosen]
        batch, _ = make_batch(rows)
        trainer.global_steps = step
        trainer._seal_step(batch)
        advantages = batch.batch["advantages"][:, 0].double()  # one value per episode (outcome reward)
        onehot = torch.nn.functional.one_hot(torch.tensor(chosen), len(OPTIONS)).double()
        logits += lr * (advantages[:, None] * (onehot - probs)).mean(0)  # the policy gradient of log pi(choice)
        counts[step] = {name: chosen.count(i) for i, name in enumerate(OPTIONS)} | {"other": 0}
    return counts


def test_the_verdict_detects_a_broken_tag_scale_advantage_link(options, tmp_path, monkeypatch):
    weights = compose_recipe(str(REPO / RECIPE)).seal.apatch.tag_weights
    recipe_apatch = [f"seal.apatch.tag_weights.{tag}={w}" for tag, w in weights.items()]
    seeds = range(4)

    def runs(mode: str) -> dict:
        switch = ["seal.apatch.enable=false"] if mode == "off" else []
        return {
            seed: simulated_run(make_trainer(tmp_path / f"{mode}{seed}", *recipe_apatch, *switch), options, seed)
            for seed in seeds
        }

    on, off = runs("on"), runs("off")
    import seal.trainer

    real_apply = seal.trainer.apply_apatch

    def scales_computed_not_applied(advantages, *args, **kwargs):
        _, metrics = real_apply(advantages, *args, **kwargs)  # weights moved, metrics logged ...
        return advantages, metrics  # ... but the advantages trained on are GRPO's own

    monkeypatch.setattr(seal.trainer, "apply_apatch", scales_computed_not_applied)
    broken = runs("broken")

    working = learning_check.steering_verdict({s: {"on": on[s], "off": off[s]} for s in seeds}, 2.0)
    assert working["passed"], working
    detected = learning_check.steering_verdict({s: {"on": broken[s], "off": off[s]} for s in seeds}, 2.0)
    assert not detected["passed"], detected

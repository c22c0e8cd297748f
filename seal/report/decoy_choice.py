"""How the CPU learning checks read a policy's first call: the recipe's warm-start decoys (the right first call and
the replacements a warm start taught), which of them an episode's first call chose, and what the environment makes
of each (its tags and A-Patch scale). ``scripts/learning_check.py`` and ``scripts/apatch_exact.py`` (and the GPU
version) measure with these; they live here, not in one of the scripts, so that neither script imports the other's
internals.
"""

from __future__ import annotations

import functools
import math

from omegaconf import OmegaConf

from seal.launch.recipe import REPO_ROOT, compose_recipe


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation over sqrt(n))."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


@functools.cache
def composed(recipe: str, overrides: tuple[str, ...] = ()):
    """``recipe`` composed once per process (Hydra takes a second or two a composition); callers only read it."""
    return compose_recipe(str(REPO_ROOT / recipe), list(overrides))


def recipe_decoys(recipe: str) -> dict[str, list[str]]:
    """The recipe's warm-start decoys: ``{task: [old, new, ...]}``."""
    return dict(composed(recipe).seal.tiny_model.warm_start.get("decoys") or {})


def choice_roles(decoys: dict[str, list[str]]) -> dict[str, str]:
    """{text: "right" | "decoy"} for the texts of warm-start decoys (``{task: [old, new, ...]}``): the first
    ground-truth call's text is right, its replacements are decoys."""
    roles: dict[str, str] = {}
    for task, (right, *wrong) in decoys.items():
        for text, role in ((right, "right"), *((w, "decoy") for w in wrong)):
            if roles.setdefault(text, role) != role:
                raise SystemExit(f"{text!r} is a right first call and a decoy ({task}): the choice is ambiguous")
    return roles


def first_call_choice(output: str, roles: dict[str, str]) -> str:
    """What an episode's first call chose: "right", "decoy", or "other" (neither: a broken or different call)."""
    first_call = output.split("</tool_call>", 1)[0]
    found = {role for text, role in roles.items() if text in first_call}
    return found.pop() if len(found) == 1 else "other"


class FirstChoice:
    """The open first-call choice of the steering recipe's task, judged by the environment: a first message's tags are
    those of the episode that sends it and then the ground truth's other messages (the service's own episode code;
    cached, an episode takes a fraction of a second and a run repeats a few first messages many times)."""

    def __init__(self, recipe: str):
        from env_service.bfcl.config import EnvConfig
        from env_service.bfcl.tasks import load_task
        from seal.apatch import APatchConfig, resolve_weights
        from seal.cpu.warm_start import episode_texts

        config = composed(recipe)
        self.apatch = APatchConfig.from_dict(config.seal.apatch)
        self.weights = resolve_weights(self.apatch)
        ((task_id, (old, *wrong)),) = recipe_decoys(recipe).items()  # one task, whose first call is the open choice
        self.task = load_task(task_id)
        self.env = EnvConfig.from_dict(OmegaConf.to_container(config.env_service.bfcl, resolve=True))
        self.texts = [episode_texts(self.task, self.env.tool_prompt_mode, None)] + [
            episode_texts(self.task, self.env.tool_prompt_mode, (old, new)) for new in wrong
        ]
        self._evaluations: dict[tuple, dict] = {}

    def evaluation(self, first_message: str, reward=None) -> dict:
        """The environment's evaluation of the episode that sends ``first_message`` and then the ground truth's
        other messages (``reward``: an ``env_service.bfcl.config.RewardConfig``, default the episode's own)."""
        key = (first_message, reward)
        if key not in self._evaluations:
            from env_service.bfcl.episode import Episode

            episode = Episode(self.task, "train", self.env)
            try:
                episode.initial_messages()
                for text in [first_message, *self.texts[0][1:]]:
                    if episode.step(text).terminated:
                        break
                self._evaluations[key] = episode.evaluate(reward)
            finally:
                episode.close()
        return self._evaluations[key]

    def tags(self, first_message: str) -> tuple[str, ...]:
        return tuple(self.evaluation(first_message)["tags"])

    def scale(self, tags) -> float:
        """The A-Patch scale the recipe's static weights give an episode of these tags."""
        from seal.apatch import row_scale

        a = self.apatch
        return row_scale(list(tags), self.weights, a.min_scale, a.max_scale, a.excluded_tags)

    def options(self) -> dict[str, dict]:
        """``{"right" | "heavy" | "light": {"text": first message, "tags": [...], "scale": s}}``: the warm start's
        right first message and its decoys, heavy and light being the decoys of the largest and the smallest A-Patch
        scale. The check means nothing unless the two decoys' tags and scales differ, so that is refused here."""
        right, *decoys = (
            {"text": texts[0], "tags": list(self.tags(texts[0])), "scale": self.scale(self.tags(texts[0]))}
            for texts in self.texts
        )
        decoys.sort(key=lambda option: option["scale"])
        if len(decoys) != 2 or decoys[0]["scale"] == decoys[1]["scale"] or decoys[0]["tags"] == right["tags"]:
            raise SystemExit(f"the steering check needs two failing decoys of different A-Patch scales, got {decoys}")
        return {"right": right, "heavy": decoys[1], "light": decoys[0]}


def first_message(output: str) -> str:
    """The model's first message in a decoded episode (special tokens skipped: the environment's turn that follows
    begins with the role name "user" on a line of its own)."""
    return output.split("\nuser\n", 1)[0]

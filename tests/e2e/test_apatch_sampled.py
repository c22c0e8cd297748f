"""Stage C's harness (``scripts/apatch_sampled.py``, docs/learning-check.md) on the real pieces: the policy samples
its own first messages, the environment's episode code plays them, and Stage A's update (verl's GRPO,
``SealTrainer._seal_step``, verl's actor loss, the released AdamW) trains on them; a tiny ``bfcl_bpe`` model
warm-started on the three candidates with the prompt cut to its last 64 tokens (the 3.3k-token prompt is most of a
step's cost; the harness is about what follows it).

- the batched sampler (rows that share a prefix share a forward pass) draws what each row drawn alone does;
- the harness sees a broken tag -> scale link: with A-Patch's scales forced to 1 the primary contrasts are exactly 0
  in every seed and the rule fails; with the link intact they are not 0, they lie in the predicted direction, and the
  negative control (``ones`` == ``off``) holds to the last bit;
- ``learning_check.py --apatch-sampled`` prints each arm's M per step and the verdict, and its exit status follows the
  rule.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import apatch_exact  # noqa: E402
import apatch_sampled  # noqa: E402
import learning_check  # noqa: E402

MODEL_DIR = REPO / ".cache" / "tiny-bfcl-bpe"
SEEDS = (1, 2, 3)
SHAPE = (2, 8)  # two GRPO groups of eight: the harness's logic, not the released batch's power
ARMS = ("on", "neutral", "swapped", "off", "ones")


@pytest.fixture(scope="module")
def tiny():
    """The tiny model warm-started (60 steps) on the three candidates' episodes, which leaves them at comparable
    probabilities (about 0.19 / 0.09 / 0.18) as the recipe's warm start does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seal.cpu.tiny_model import build_tiny_model
    from seal.cpu.warm_start import fit_examples

    model_dir = build_tiny_model(MODEL_DIR, shape="bfcl_bpe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    candidates = apatch_exact.shortened(apatch_exact.load_candidates(tokenizer, model.config.model_type), 64)
    torch.manual_seed(0)
    fit_examples(model, [[(c.ids, c.mask) for c in candidates.values()]], 60, 3e-3)
    reference = copy.deepcopy(model).eval()
    fresh = apatch_exact.Start({k: v.detach().clone() for k, v in model.state_dict().items()})
    pool = apatch_sampled.EpisodePool(candidates, tokenizer, model.config.model_type)
    return model, reference, fresh, pool


def study(tiny, arms=ARMS) -> dict:
    model, reference, fresh, pool = tiny
    return {
        seed: apatch_sampled.run_seed(
            model,
            reference,
            fresh,
            pool,
            seed,
            trunk_updates=1,
            arm_updates=2,
            conditions={"warmed": arms},
            shape=SHAPE,
        )  # fmt: skip
        for seed in SEEDS
    }


@pytest.fixture(scope="module")
def intact(tiny):
    return study(tiny)


@pytest.fixture(scope="module")
def broken(tiny):
    """The same study with every A-Patch scale forced to 1 (the tags reach A-Patch, their weights do nothing)."""
    import seal.apatch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(seal.apatch, "row_scale", lambda *args, **kwargs: 1.0)
        return study(tiny, arms=("on", "neutral", "swapped", "off"))


def test_the_batched_sampler_draws_what_each_row_drawn_alone_does(tiny):
    model, _, _, pool = tiny
    end = pool.tokenizer.eos_token_id
    uniforms = apatch_sampled.step_uniforms(7, 1, 12, 40)
    together = apatch_sampled.sample_messages(model, pool.prompt, uniforms, end)
    alone = [apatch_sampled.sample_messages(model, pool.prompt, uniforms[i : i + 1], end)[0] for i in range(12)]
    assert together == alone
    assert len(set(together)) > 1 and all(m[-1] == end for m in together)
    # the same uniforms give the same messages (the arms' pairing); other uniforms give others
    assert apatch_sampled.sample_messages(model, pool.prompt, uniforms, end) == together
    assert (
        apatch_sampled.sample_messages(model, pool.prompt, apatch_sampled.step_uniforms(7, 2, 12, 40), end) != together
    )


def test_the_harness_sees_a_broken_tag_to_scale_link(intact, broken):
    primary = apatch_sampled.PRIMARY
    for contrast in primary:
        values = apatch_sampled.contrast_values(broken, contrast)
        assert values == [0.0] * len(SEEDS), contrast.name  # the link broken: the arms cannot differ
    verdict = apatch_sampled.verdict(broken)
    assert not any(verdict["primary"].values()) and not verdict["passed"]

    # the link intact: the decoys' weights move M, in the direction the method says, in every seed
    for contrast in primary:
        values = apatch_sampled.contrast_values(intact, contrast)
        assert all(v < 0 for v in values), (contrast.name, values)
    assert apatch_sampled.verdict(intact)["negative_control"]
    # the arms were paired: the first step after the trunk sampled the same episodes in every arm
    for r in intact.values():
        firsts = {arm: run["counts"][0] for arm, run in r["conditions"]["warmed"].items()}
        assert len({json.dumps(c, sort_keys=True) for c in firsts.values()}) == 1


def test_the_negative_control_fails_when_ones_is_not_off(intact):
    tampered = copy.deepcopy(intact)
    seed = next(iter(tampered))
    tampered[seed]["conditions"]["warmed"]["ones"]["metric"][-1] += 1e-12
    assert not apatch_sampled.negative_control(tampered) and not apatch_sampled.verdict(tampered)["passed"]


def test_the_command_prints_every_arm_and_exits_by_the_rule(intact, broken, tmp_path, capsys):
    for name, results in (("intact", intact), ("broken", broken)):
        out = tmp_path / name
        out.mkdir()
        saved = {"seeds": {str(seed): r for seed, r in results.items()}}
        (out / "apatch_sampled.json").write_text(json.dumps(saved))
        args = ["--apatch-sampled", "--reuse", "--out", str(out), "--seeds", *map(str, SEEDS)]
        status = learning_check.main(args)
        printed = capsys.readouterr().out
        verdict = apatch_sampled.verdict(results)
        assert status == (0 if verdict["passed"] else 1)
        assert ("PASS" if verdict["passed"] else "FAIL") in printed
        for arm in results[SEEDS[0]]["conditions"]["warmed"]:
            assert f"warmed {arm}" in printed
        assert "on-neutral" in printed and "on-swapped" in printed
    assert "-> FAIL" in printed  # the broken link's run fails


def test_the_live_replications_rule_needs_both_contrasts_below_zero_in_every_seed():
    def runs(on_last: float) -> dict:
        arms = {arm: {"metric": {0: 0.0, 16: 0.0}} for arm in ("neutral", "swapped", "off")}
        return arms | {"on": {"metric": {0: 0.0, 16: on_last}}}

    assert learning_check.live_verdict({1: runs(-0.01), 2: runs(-0.02)}, trunk=10)["passed"]
    assert not learning_check.live_verdict({1: runs(-0.01), 2: runs(+0.02)}, trunk=10)["passed"]
    neutral_above = runs(-0.01)
    neutral_above["neutral"]["metric"][16] = -0.02  # on above neutral, still below swapped
    verdict = learning_check.live_verdict({1: neutral_above, 2: runs(-0.01)}, trunk=10)
    assert verdict["below"] == {"on-neutral": 1, "on-swapped": 2, "on-off": 2} and not verdict["passed"]
    # Stage B's registered rule (no trunk, no neutral arm) decides by on - swapped alone
    stage_b = {seed: {arm: r for arm, r in runs(-0.01).items() if arm != "neutral"} for seed in (42, 1)}
    assert learning_check.live_verdict(stage_b)["passed"]


def test_the_command_refuses_seeds_of_another_design_and_flags_outside_their_mode(tmp_path, capsys):
    design = {"lr": apatch_sampled.LIVE_LR, "trunk_updates": 10, "arm_updates": 6}
    (tmp_path / "apatch_sampled.json").write_text(json.dumps({"seeds": {"1": {}}, "design": design}))
    with pytest.raises(SystemExit, match="another design"):
        learning_check.main(["--apatch-sampled", "--reuse", "--out", str(tmp_path), "--seeds", "1"])
    for flags in (["--trunk"], ["--trunk-updates", "3"], ["--apatch-live", "--arm-updates", "2"]):
        with pytest.raises(SystemExit):
            learning_check.main([*flags, "--out", str(tmp_path)])
        assert "choice" in capsys.readouterr().err

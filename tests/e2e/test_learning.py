"""Training moves reward on CPU: ``scripts/learning_check.py`` runs exp/cpu_learning.yaml (warm-started tiny model,
GRPO through the launcher, trainer, agent loop and environment service) and its sign-flipped twin, and passes only
if the normal run's reward rises clearly over its steps and the flipped run's does not.

Both runs take about 8 minutes on 2 cores (the warm start included; it is cached under outputs/), in CI.
docs/learning-check.md has the margins of the rollout seeds tried. The statistics the check decides on are also
tested here without a run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import learning_check  # noqa: E402

from seal.report import decoy_choice  # noqa: E402


def test_compare_sees_a_rise_and_no_rise_in_flat_or_falling_rewards():
    rising = {1: [0.0, 0.5] * 8, 2: [0.0, 0.5] * 8, 3: [0.5, 1.0] * 8, 4: [1.0] * 16}
    flat = {1: [0.0, 0.5] * 8, 2: [0.5, 0.0] * 8, 3: [0.0, 0.5] * 8, 4: [0.5, 0.0] * 8}
    falling = {step: rewards for step, rewards in zip(rising, reversed(rising.values()))}
    result = learning_check.compare(rising, window=2)
    assert result["first"] == pytest.approx(0.25) and result["last"] == pytest.approx(0.875)
    assert learning_check.rises(result, sigmas=2.0, margin=0.15)
    assert not learning_check.rises(learning_check.compare(flat, window=2), sigmas=2.0, margin=0.15)
    assert not learning_check.rises(learning_check.compare(falling, window=2), sigmas=2.0, margin=0.15)


def test_mean_se_is_the_sample_standard_error():
    import statistics

    values = [0.0, 0.5, 0.5, 1.0, 0.0, 0.7]
    mean, se = decoy_choice.mean_se(values)
    assert mean == pytest.approx(statistics.fmean(values))
    assert se == pytest.approx(statistics.stdev(values) / len(values) ** 0.5)


def test_first_calls_are_classified_by_the_recipes_decoys():
    roles = decoy_choice.choice_roles(decoy_choice.recipe_decoys(learning_check.RECIPES["normal"]))
    assert roles == {'"NVDA"': "right", '"MSFT"': "decoy", '"TSLA"': "decoy", '"GOOG"': "decoy"}  # multi_turn_base_100

    def call(symbol: str) -> str:
        return f'<tool_call>\n{{"name": "get_stock_info", "arguments": {{"symbol": {symbol}}}}}\n</tool_call>'

    assert decoy_choice.first_call_choice(call('"NVDA"') + "\nDone.", roles) == "right"
    assert decoy_choice.first_call_choice(call('"GOOG"'), roles) == "decoy"
    # only the first call counts, and a call that names no choice (a broken one) is neither
    assert decoy_choice.first_call_choice(call('"MSFT"') + call('"NVDA"'), roles) == "decoy"
    assert decoy_choice.first_call_choice(call('"NV DA"'), roles) == "other"
    assert decoy_choice.first_call_choice("", roles) == "other"


def test_a_text_that_is_both_right_and_a_decoy_is_refused():
    decoys = {"multi_turn_base_100": ['"NVDA"', '"MSFT"'], "multi_turn_base_144": ['"AAPL"', '"NVDA"']}
    with pytest.raises(SystemExit, match="ambiguous"):
        decoy_choice.choice_roles(decoys)


@pytest.mark.slow
@pytest.mark.learning
def test_grpo_raises_reward_and_its_sign_flipped_twin_does_not(tmp_path):
    out = tmp_path / "learning_check"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "learning_check.py"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "learning_check.json").exists(), log  # both runs finished and were analysed
    summary = json.loads((out / "learning_check.json").read_text())
    normal, flipped = summary["results"]["normal"], summary["results"]["flipped"]
    assert proc.returncode == 0, log
    assert normal["diff"] > 2 * normal["diff_se"] and normal["diff"] >= 0.15
    assert not flipped["diff"] > 2 * flipped["diff_se"]
    # under the reward, the mechanism: GRPO moves the one choice the warm start left open, each way
    k = summary["window"]
    for name, direction in (("normal", 1), ("flipped", -1)):
        right = list(summary["right_first_call_per_step"][name].values())
        assert direction * (sum(right[-k:]) - sum(right[:k])) > 0, (name, right)
    for figure in summary["figures"]:
        assert Path(figure).read_bytes()[:4] == b"\x89PNG"

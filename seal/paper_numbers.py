"""The SEAL paper's reported numbers (BFCL V3 multi-turn, the 400 held-out tasks, accuracy in percent): the one
place they live. ``scripts/make_tables.py`` prints them beside ours.

Table 1 gives every column; the ablation (Qwen2.5-7B-Instruct) reports the Average only, so its per-category
cells are None (unknown, never filled in). Each category has 100 held-out tasks; the Average is the mean of the
four categories (= passes / 400).
"""

from __future__ import annotations

TASKS_PER_CATEGORY = 100
COLUMNS = ("average", "base", "miss_func", "miss_param", "long_context")
BACKBONES = ("Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "ToolACE-2-Llama-3.1-8B")
TRAININGS = ("base", "vanilla_rl", "seal")
TRAINING_NAMES = {"base": "base model", "vanilla_rl": "+ Vanilla RL", "seal": "+ SEAL"}


def _row(average, base, miss_func, miss_param, long_context) -> dict[str, float | None]:
    return dict(zip(COLUMNS, (average, base, miss_func, miss_param, long_context)))


#: Table 1: (backbone, training) -> {column: accuracy %}.
TABLE1: dict[tuple[str, str], dict[str, float | None]] = {
    ("Qwen2.5-3B-Instruct", "base"): _row(5.75, 11.00, 6.00, 3.00, 3.00),
    ("Qwen2.5-3B-Instruct", "vanilla_rl"): _row(9.25, 16.00, 9.00, 6.00, 6.00),
    ("Qwen2.5-3B-Instruct", "seal"): _row(14.00, 19.00, 15.00, 12.00, 10.00),
    ("Qwen2.5-7B-Instruct", "base"): _row(14.00, 22.00, 14.00, 10.00, 10.00),
    ("Qwen2.5-7B-Instruct", "vanilla_rl"): _row(30.75, 46.00, 27.00, 27.00, 23.00),
    ("Qwen2.5-7B-Instruct", "seal"): _row(40.25, 58.00, 36.00, 34.00, 33.00),
    ("ToolACE-2-Llama-3.1-8B", "base"): _row(32.00, 45.00, 26.00, 35.00, 22.00),
    ("ToolACE-2-Llama-3.1-8B", "vanilla_rl"): _row(38.50, 52.00, 30.00, 40.00, 32.00),
    ("ToolACE-2-Llama-3.1-8B", "seal"): _row(46.75, 58.00, 46.00, 44.00, 39.00),
}

#: The ablation on Qwen2.5-7B-Instruct, keyed by the recipe's experiment name (exp/*.yaml): Average only.
ABLATION: dict[str, dict[str, float | None]] = {
    "SEAL": _row(40.25, None, None, None, None),
    "wo_env_adaptation": _row(35.75, None, None, None, None),
    "wo_reweighting": _row(32.75, None, None, None, None),
    "wo_closed_loop": _row(33.00, None, None, None, None),
}
ABLATION_NAMES = {
    "SEAL": "full SEAL",
    "wo_env_adaptation": "w/o environment adaptation",
    "wo_reweighting": "w/o reweighting",
    "wo_closed_loop": "w/o closed loop",
}

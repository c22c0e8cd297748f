"""Preflight's GPU-node checks: the attention backend, the CUDA runtime vs the driver, padding removal.

Tests run without a GPU: whether flash-attn imports is set through ``sys.modules`` (the import is the boundary),
and the CUDA probe (torch's build, nvidia-smi, CUDA init) is replaced at its boundary,
``seal.launch.node_checks.probe_cuda``, to test the mismatch logic.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from seal.launch import node_checks
from seal.launch.preflight import preflight
from seal.launch.recipe import PreflightError, compose_recipe

ROOT = Path(__file__).resolve().parents[2]
SEAL = str(ROOT / "exp" / "SEAL.yaml")


def _problems(recipe: str, overrides=()) -> list[str]:
    try:
        preflight(compose_recipe(recipe, list(overrides)))
    except PreflightError as err:
        return str(err).splitlines()[1:]
    return []


def _matching(problems: list[str], text: str) -> list[str]:
    return [p for p in problems if text in p]


# ---- attention backend ----------------------------------------------------------------------------


@pytest.fixture
def no_flash_attn(monkeypatch):
    """The state of a `verl[vllm]`-only GPU install (and of this CPU machine): `import flash_attn` fails."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)


def test_gpu_recipe_names_flash_attention_and_preflight_says_how_to_get_it(no_flash_attn):
    assert node_checks.attention_problem("flash_attention_2") is not None
    [line] = _matching(_problems(SEAL), "attn_implementation 'flash_attention_2'")
    assert "`flash_attn`" in line and "bash scripts/install.sh gpu" in line


def test_verl_default_attention_is_checked_when_the_recipe_names_none(no_flash_attn):
    cfg = compose_recipe(SEAL, ["~actor_rollout_ref.model.override_config.attn_implementation"])
    assert node_checks.attention_implementation(cfg.actor_rollout_ref.model) == "flash_attention_2"  # verl's default
    with pytest.raises(PreflightError, match="attn_implementation 'flash_attention_2'"):
        preflight(cfg)


def test_attention_that_imports_passes(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # an installed flash-attn
    assert node_checks.attention_problem("flash_attention_2") is None
    assert not _matching(_problems(SEAL), "attn_implementation")


def test_torch_builtin_attention_needs_nothing():
    for implementation in ("sdpa", "eager"):
        assert node_checks.attention_problem(implementation) is None
    assert not _matching(_problems(str(ROOT / "exp" / "cpu_tiny.yaml")), "attn_implementation")


# ---- CUDA runtime vs driver -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ({"torch_cuda": None, "driver": None, "init_error": None}, "is a CPU build"),
        ({"torch_cuda": "13.0", "driver": "550.54.15", "init_error": None}, "needs driver >= 580"),
        (
            {"torch_cuda": "13.0", "driver": "575.57.08", "init_error": "The NVIDIA driver on your system is too old"},
            "needs driver >= 580",
        ),
        ({"torch_cuda": "12.8", "driver": "570.1", "init_error": "CUDA unknown error"}, "does not initialise"),
        ({"torch_cuda": "13.0", "driver": "580.65.06", "init_error": None}, None),
        ({"torch_cuda": "12.8", "driver": "550.54.15", "init_error": None}, None),
    ],
)
def test_cuda_driver_mismatch_is_one_line(probe, expected):
    problem = node_checks.cuda_problem(torch_version="2.11.0", **probe)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "\n" not in problem


def test_probe_reads_the_driver_from_nvidia_smi_and_the_reason_from_cuda_init(monkeypatch, tmp_path):
    import torch

    smi = tmp_path / "nvidia-smi"  # a stand-in for the real tool, answering the query the probe makes
    smi.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=driver_version" ] && printf "550.54.15\\n550.54.15\\n"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12040).\nPlease update")

    monkeypatch.setattr(torch.cuda, "init", init)
    probe = node_checks.probe_cuda()
    assert (probe["driver"], probe["init_error"]) == (
        "550.54.15",
        "The NVIDIA driver on your system is too old (found version 12040).",
    )
    assert "needs driver >= 580" in node_checks.cuda_problem(**probe)


def test_no_nvidia_smi_means_no_driver_version(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert node_checks.nvidia_driver_version() is None


def test_preflight_names_the_driver_mismatch(monkeypatch):
    probe = {"torch_version": "2.11.0+cu130", "torch_cuda": "13.0", "driver": "550.54.15", "init_error": None}
    monkeypatch.setattr(node_checks, "probe_cuda", lambda: probe)
    [line] = _matching(_problems(SEAL), "NVIDIA driver 550.54.15")
    assert "torch 2.11.0+cu130" in line and "CUDA 13.0" in line and "driver >= 580" in line


def test_cpu_recipes_skip_the_cuda_check(monkeypatch):
    monkeypatch.setattr(node_checks, "probe_cuda", lambda: pytest.fail("probed CUDA for a CPU recipe"))
    assert not _matching(_problems(str(ROOT / "exp" / "cpu_tiny.yaml")), "CUDA")


# ---- padding removal ------------------------------------------------------------------------------

SDPA = "actor_rollout_ref.model.override_config.attn_implementation=sdpa"
SEVERAL_PER_MICRO_BATCH = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
]


@pytest.fixture
def no_packed_sequence_detection(monkeypatch):
    """A transformers that cannot tell packed sequences apart for mask-based attention (tests/rollout/test_packing.py)."""
    monkeypatch.setattr(node_checks, "transformers_detects_packed_sequences", lambda: False)


@pytest.mark.parametrize("several", SEVERAL_PER_MICRO_BATCH)
def test_padding_removal_that_would_mix_sequences_is_refused(several, no_packed_sequence_detection):
    setting = several.split("actor_rollout_ref.")[1].split("=")[0].replace("_per_gpu", "")
    [line] = _matching(_problems(SEAL, [SDPA, several]), "use_remove_padding")
    assert "'sdpa'" in line and setting in line


@pytest.mark.parametrize(
    "overrides",
    [
        [SDPA],  # the recipe's one sequence per micro-batch: nothing is packed together
        [
            SDPA,
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ],
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],  # flash attention separates packed sequences
    ],
)
def test_padding_removal_is_allowed_when_sequences_stay_apart(overrides, no_packed_sequence_detection):
    assert not _matching(_problems(SEAL, overrides), "use_remove_padding")


@pytest.mark.parametrize("several", SEVERAL_PER_MICRO_BATCH)
def test_sdpa_packing_is_allowed_where_transformers_separates_packed_sequences(several):
    assert node_checks.transformers_detects_packed_sequences()  # the installed transformers (5.x) does
    assert not _matching(_problems(SEAL, [SDPA, several]), "use_remove_padding")


def test_a_bad_environment_block_is_a_preflight_problem_not_a_traceback():
    problems = _problems(str(ROOT / "exp" / "cpu_tiny.yaml"), ["env_service.bfcl.tool_prompt_mode=nope"])
    assert _matching(problems, "env_service.bfcl: config key 'tool_prompt_mode'")

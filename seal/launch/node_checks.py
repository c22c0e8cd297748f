"""What this machine must provide for a recipe: the attention backend it names, and a CUDA runtime the driver runs.

Both fail late and far from their cause otherwise: a missing ``flash_attn`` raises ImportError inside the FSDP
actor/ref model build on every GPU worker, and a driver older than the CUDA runtime that torch was built with
shows up as "0 CUDA devices" or a CUDA initialisation error. Preflight turns each into one line saying what to do.
"""

from __future__ import annotations

import importlib
import subprocess

#: verl's FSDP model config uses this when ``model.override_config.attn_implementation`` is not set.
VERL_DEFAULT_ATTENTION = "flash_attention_2"

#: attn_implementation -> (module it imports, how to get it). sdpa / eager / flex_attention come with torch.
ATTENTION_MODULES = {
    "flash_attention_2": (
        "flash_attn",
        "`bash scripts/install.sh gpu` installs flash-attn 2.8.3 (the prebuilt wheel for torch 2.11 + CUDA 13)",
    ),
    "flash_attention_3": ("flash_attn_interface", "install FlashAttention-3 (flash-attention's hopper/ build)"),
}

#: Attentions that take transformers' attention mask. Given packed sequences (padding removal: one row, restarting
#: position ids, no mask, no cache -- verl's forward), transformers builds a block-diagonal mask from the position
#: ids (`masking_utils.find_packed_sequence_indices`); without that detection they attend across sequences.
MASK_ATTENTION = frozenset({"sdpa", "eager", "flex_attention"})

#: Oldest Linux NVIDIA driver (major version) that runs each CUDA major's runtime (CUDA minor-version compatibility).
MIN_DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}


def attention_implementation(model_config) -> str:
    """The attention implementation verl will build the actor/ref model with."""
    override = model_config.get("override_config") or {}
    return str(override.get("attn_implementation") or VERL_DEFAULT_ATTENTION)


def separates_packed_sequences(implementation: str) -> bool:
    """Whether sequences packed into one row stay apart: flash attention's varlen kernels read the boundaries from
    the restarting position ids; mask-based attentions need transformers' packed-sequence detection."""
    if "flash" in implementation:
        return True
    return implementation in MASK_ATTENTION and transformers_detects_packed_sequences()


def transformers_detects_packed_sequences() -> bool:
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def attention_problem(implementation: str) -> str | None:
    """One line if ``implementation`` cannot be loaded here, else None."""
    if implementation not in ATTENTION_MODULES:
        return None
    module, how = ATTENTION_MODULES[implementation]
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or an extension built for another torch/CUDA (undefined symbol)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            f"attn_implementation {implementation!r} (actor_rollout_ref.model.override_config) needs the "
            f"`{module}` module, which does not import here ({reason}): {how}"
        )
    return None


def cuda_problem(torch_version: str, torch_cuda: str | None, driver: str | None, init_error: str | None) -> str | None:
    """One line naming a torch-CUDA-runtime / NVIDIA-driver mismatch, else None."""
    if torch_cuda is None:
        return (
            f"torch {torch_version} is a CPU build but the recipe trains on CUDA: install the GPU stack into this "
            "environment (`bash scripts/install.sh gpu`)"
        )
    need = MIN_DRIVER_FOR_CUDA.get(int(torch_cuda.split(".")[0]))
    driver_major = _major(driver)
    if need and driver_major is not None and driver_major < need:
        return (
            f"NVIDIA driver {driver} is too old for torch {torch_version} (built with CUDA {torch_cuda}, which needs "
            f"driver >= {need}): update the driver, or install a torch built for a CUDA your driver supports"
        )
    if init_error:
        return (
            f"CUDA does not initialise (torch {torch_version} built with CUDA {torch_cuda}, NVIDIA driver "
            f"{driver or 'not found by nvidia-smi'}): {init_error}"
        )
    return None


def probe_cuda() -> dict:
    """torch's version and CUDA runtime, the NVIDIA driver (nvidia-smi), and CUDA's initialisation error if any."""
    import torch

    init_error = None
    # only when CUDA is unusable anyway: initialising it in the launcher would hold a context on GPU 0 all run
    if torch.version.cuda is not None and not torch.cuda.is_available():
        try:
            torch.cuda.init()  # raises the reason, e.g. "The NVIDIA driver on your system is too old"
        except Exception as exc:
            init_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return {
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": nvidia_driver_version(),
        "init_error": init_error,
    }


def nvidia_driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None

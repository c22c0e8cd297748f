#!/usr/bin/env python
"""The device check for a GPU lent for minutes: everything the first GPU hour must show, one command, one summary.

    python scripts/gpu_check.py --out experiments/gpu_check              # one H100: under 10 minutes
    python scripts/gpu_check.py --out /tmp/gpu_check --skip-gpu          # any machine: the GPU steps skipped

Four steps, the GPU ones bounded in time (:data:`SMOKE_S`, :data:`APATCH_S`) so that the whole stays under 10 minutes:

1. ``install``: the stack imports (seal, verl 0.9.1, vLLM, torch with CUDA, flash-attn) and the GPU it sees;
2. ``estimate``: ``launcher.py --dry-run``'s memory estimate per GPU for ``exp/gpu_smoke.yaml`` as run here (the
   higher of the rollout and training peaks, ``seal/launch/memory_estimate.py``);
3. ``gpu_smoke``: ``exp/gpu_smoke.yaml``'s 2 GRPO steps through verl's vLLM server, the actor's weights synced into
   vLLM before each step's rollout (the metrics' ``timing_s/update_weights``), while ``nvidia-smi`` samples the
   memory used on each GPU; ``memory_ratio`` is the peak measured over the estimate;
4. ``apatch_exact``: the A-Patch exact measurement's GPU condition (``scripts/apatch_exact_gpu.py``, one seed).

The model is the recipe's when this machine has it (a folder, or the Hugging Face cache); a lent GPU reaches no hub,
so otherwise it is the tiny Qwen2.5-vocabulary model ``prepare`` builds offline (``seal.tiny_model``), which runs
the same stack. Every result is one line of ``<out>/summary.txt`` (``name: status | detail``, status ``ok``,
``failed`` or ``skipped``); the steps' logs lie beside it. Exit 1 when a step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "exp/gpu_smoke.yaml"
#: Each GPU step's time limit, with the install and the estimate (under a minute) 10 minutes in all: the launcher's
#: start (environment service, Ray, vLLM's engine and CUDA graphs) and 2 steps with 3 validations of 8 tasks take
#: most; the A-Patch measurement gets the rest. Not yet run on a GPU: limits, not measurements.
SMOKE_S = 390
APATCH_S = 150
#: One of the pilot's batch seeds (``scripts/apatch_exact.py``), for the time: its four conditions x four arms.
APATCH_SEED = ("--seeds", "1001")
SAMPLE_S = 0.5  # how often nvidia-smi is asked for the memory used
GIB = 1024**3


class Summary:
    """The check's results, one line each, written to ``path`` after every step (a check cut short keeps its lines)."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []

    def add(self, name: str, status: str, detail: str) -> None:
        self.lines.append(f"{name}: {status} | {detail}")
        print(self.lines[-1], flush=True)
        self.path.write_text("\n".join(self.lines) + "\n")

    @property
    def failed(self) -> bool:
        return any(": failed |" in line for line in self.lines)


# ---- 1. the install ------------------------------------------------------------------------------------------


def install_check(gpu: bool) -> tuple[str, str]:
    """Versions of the stack; failed when verl is not 0.9.1 or, with a GPU, vLLM or flash-attn is missing."""
    import torch
    import verl

    found = [f"verl {verl.__version__}", f"torch {torch.__version__}"]
    problems = [] if verl.__version__ == "0.9.1" else [f"verl {verl.__version__}, not 0.9.1"]
    try:
        import vllm

        found.append(f"vllm {vllm.__version__}")
    except ImportError as exc:  # the CPU install has none: only the GPU steps need it
        (problems if gpu else found).append(f"vllm: {exc}")
    if gpu:
        found.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
        try:
            import flash_attn

            found.append(f"flash-attn {flash_attn.__version__}")
        except ImportError as exc:
            problems.append(f"flash-attn: {exc}")
    return ("failed" if problems else "ok"), "; ".join(problems + found)


# ---- 2. the estimate -------------------------------------------------------------------------------------------


def smoke_overrides(out: Path, model: str | None) -> tuple[list[str], str]:
    """The recipe's overrides for this check (its folders under ``out``, the model) and which model it runs."""
    from seal.launch.recipe import compose_recipe

    overrides = [
        f"seal.run_dir={out / 'run'}",
        f"trainer.default_local_dir={out / 'checkpoints'}",
    ]
    model = model or str(compose_recipe(RECIPE).actor_rollout_ref.model.path)
    if model != "tiny" and (os.path.exists(model) or _cached(model)):
        return overrides + [f"actor_rollout_ref.model.path={model}"], model
    tiny = out / "tiny_model"
    built = ["seal.tiny_model.build=true", f"seal.tiny_model.out_dir={tiny}", f"actor_rollout_ref.model.path={tiny}"]
    return overrides + built, f"the tiny model built offline at {tiny} ({model} is not on this machine)"


def _cached(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    with contextlib.suppress(ValueError):
        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    return False


def estimated_peak(overrides: list[str]) -> float:
    """The dry run's memory estimate per GPU (bytes): the higher of its rollout and training peaks."""
    from seal.launch.memory_estimate import estimate
    from seal.launch.recipe import compose_recipe, prepare

    config = prepare(compose_recipe(RECIPE, overrides))  # builds the tiny model when the check runs it
    found = estimate(config)
    if found is None:
        raise RuntimeError(f"{config.actor_rollout_ref.model.path}: no config.json, no known size")
    return max(found.rollout_total_bytes, found.training.total_bytes)


# ---- 3. gpu_smoke ----------------------------------------------------------------------------------------------


class GpuMemory:
    """The most memory used on each GPU while it runs (``nvidia-smi``, every :data:`SAMPLE_S`), in bytes."""

    def __init__(self):
        self.peak: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            used = parse_memory_used(
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                ).stdout
            )
            self.peak = [max(a, b) for a, b in zip(self.peak, used)] if self.peak else used


def parse_memory_used(text: str) -> list[int]:
    """``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits`` (MiB, one GPU a line) in bytes."""
    return [int(line) * 1024**2 for line in text.split()]


def run_smoke(out: Path, overrides: list[str]) -> tuple[int, list[int], float]:
    """The launcher on the recipe (exit code, peak memory per GPU, seconds), its output in ``gpu_smoke.log``."""
    start = time.monotonic()
    with GpuMemory() as memory, open(out / "gpu_smoke.log", "w") as log:
        try:
            code = subprocess.run(
                [sys.executable, str(ROOT / "launcher.py"), "--conf", RECIPE, *overrides],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=SMOKE_S,
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, memory.peak, time.monotonic() - start


def steps_and_syncs(run_dir: Path) -> tuple[int, list[float]]:
    """Training steps in the run's metrics and the seconds of each step's weight sync (``timing_s/update_weights``)."""
    steps, syncs = set(), []
    for path in glob.glob(str(run_dir / "metrics_*.jsonl")):
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            data = record.get("data", {})
            if "training/global_step" in data or "actor/pg_loss" in data:
                steps.add(record["step"])
            if "timing_s/update_weights" in data:
                syncs.append(float(data["timing_s/update_weights"]))
    return len(steps), syncs


def smoke_lines(summary: Summary, out: Path, overrides: list[str], estimate: float | None) -> None:
    code, peak, seconds = run_smoke(out, overrides)
    steps, syncs = steps_and_syncs(out / "run")
    how = "timed out" if code == -1 else f"exit {code}"
    detail = f"{how} in {seconds:.0f} s; {steps} training step(s); log {out / 'gpu_smoke.log'}"
    summary.add("gpu_smoke", "ok" if code == 0 and steps == 2 else "failed", detail)
    sync = f"{len(syncs)} sync(s), {', '.join(f'{s:.1f} s' for s in syncs)}" if syncs else "none in the metrics"
    summary.add("weight_sync", "ok" if syncs else "failed", sync)
    if not peak or estimate is None:
        summary.add("memory_ratio", "failed", "no peak measured" if not peak else "no estimate")
        return
    top = max(peak)
    per_gpu = ", ".join(f"{p / GIB:.1f}" for p in peak)
    detail = f"{top / estimate:.2f} (peak {top / GIB:.1f} GiB [per GPU: {per_gpu}] / estimate {estimate / GIB:.1f} GiB)"
    summary.add("memory_ratio", "ok" if top <= estimate else "failed", detail)


# ---- 4. the A-Patch exact measurement on the GPU -------------------------------------------------------------------


def apatch_line(summary: Summary, out: Path) -> None:
    folder = out / "apatch_exact_gpu"
    start = time.monotonic()
    with open(out / "apatch_exact_gpu.log", "w") as log:
        try:
            code = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "apatch_exact_gpu.py"), "--out", str(folder), *APATCH_SEED],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=APATCH_S,
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    seconds = time.monotonic() - start
    result = folder / "apatch_exact_gpu.json"
    if code != 0 or not result.exists():
        how = "timed out" if code == -1 else f"exit {code}"
        summary.add("apatch_exact", "failed", f"{how} in {seconds:.0f} s; log {out / 'apatch_exact_gpu.log'}")
        return
    exact, total = negative_controls(json.loads(result.read_text()))
    detail = f"negative control exact in {exact} of {total} condition(s); {seconds:.0f} s; {result}"
    summary.add("apatch_exact", "ok" if exact == total else "failed", detail)


def negative_controls(result: dict) -> tuple[int, int]:
    """Conditions whose negative control (all-ones weights) matched ``off`` at every update, of all conditions."""
    runs = [c["arms"] for seed in result["seeds"].values() for c in seed["conditions"].values()]
    return sum(arms["ones"]["metric"] == arms["off"]["metric"] for arms in runs), len(runs)


# ---- the check ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder of summary.txt and the steps' logs")
    parser.add_argument("--skip-gpu", action="store_true", help="skip the GPU steps (also when no GPU is visible)")
    parser.add_argument("--model", help="the model gpu_smoke runs (default: the recipe's if here, else 'tiny')")
    args = parser.parse_args(argv)
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(out / "summary.txt")
    gpu = not args.skip_gpu and torch.cuda.is_available()
    why_not = "--skip-gpu" if args.skip_gpu else "no CUDA device visible"
    summary.add("install", *install_check(gpu))
    overrides, model = smoke_overrides(out, args.model)
    summary.add("model", "ok", model)
    try:
        estimate = estimated_peak(overrides)
        summary.add("estimate", "ok", f"{estimate / GIB:.1f} GiB per GPU (the higher of rollout and training peak)")
    except Exception as exc:  # said in its line; the GPU steps still run
        estimate = None
        summary.add("estimate", "failed", f"{type(exc).__name__}: {exc}")
    if gpu:
        smoke_lines(summary, out, overrides, estimate)
        apatch_line(summary, out)
    else:
        for name in ("gpu_smoke", "weight_sync", "memory_ratio", "apatch_exact"):
            summary.add(name, "skipped", why_not)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())

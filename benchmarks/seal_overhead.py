"""What SEAL adds to a training step, measured in one run on this machine.

1. Whole-step time of the SEAL recipe vs the vanilla-RL recipe: the same embedded CPU run (exp/cpu_tiny.yaml:
   tiny model, same seed, same tasks) launched twice through the launcher, once as-is and once with vanilla's
   switches (no schema cues, no diagnosis, no A-Patch). Reported: mean ``timing_s/step`` and the parts, as
   SEAL / vanilla ratios (target: step ratio <= 1.05).
2. The diagnosis-guided part alone at recipe scale: tags -> capability state -> dynamic weights -> A-Patch for
   a 256-trajectory batch, relative to verl's ``compute_grpo_outcome_advantage`` (benchmarks/apatch_overhead.py).

    python benchmarks/seal_overhead.py [--steps 2] [--skip-steps]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.apatch_overhead import measure  # noqa: E402
from seal.eval.serve import free_port  # noqa: E402

VANILLA_SWITCHES = [
    "env_service.bfcl.observation_lite.enable=false",
    "seal.diagnosis.enable=false",
    "seal.apatch.enable=false",
    "seal.apatch.dynamic.enable=false",
]
PARTS = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/seal_step",
)


def run_recipe(name: str, switches: list[str], steps: int, work: Path) -> dict[str, float]:
    """Train ``steps`` steps of cpu_tiny (no validation, no checkpoints) and return the mean timing per part."""
    out = work / name
    metrics_path = out / "metrics.jsonl"
    cmd = [
        sys.executable,
        str(REPO / "launcher.py"),
        "--conf",
        str(REPO / "exp" / "cpu_tiny.yaml"),
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "seal.checkpoint.save_best=false",
        f"trainer.default_local_dir={out}/ckpt",
        f"seal.run_dir={out}",
        f"env_service.port={free_port()}",
        *switches,
    ]
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path)}
    print(f"[bench] {name}: training {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line)["data"] for line in metrics_path.read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "timing_s/step" in r]
    return {part: statistics.mean([float(r.get(part, 0.0)) for r in steps_rows]) for part in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per recipe")
    parser.add_argument("--skip-steps", action="store_true", help="only the A-Patch micro-benchmark")
    args = parser.parse_args()

    print("== tags -> capability state -> A-Patch, 256 trajectories x 4096 tokens, vs verl GRPO advantage ==")
    m = measure(batch=256, response_len=4096, repeats=30)
    print(f"verl GRPO advantage      {1e3 * m['grpo_s']:8.2f} ms")
    print(
        f"SEAL observe + A-Patch   {1e3 * m['seal_s']:8.2f} ms   (observe {1e3 * m['observe_s']:.2f}, "
        f"weights + scaling {1e3 * m['apatch_s']:.2f})"
    )
    print(f"ratio SEAL / GRPO        {m['ratio']:8.2f}")
    if args.skip_steps:
        return

    print(f"\n== step time, exp/cpu_tiny.yaml, SEAL vs vanilla RL ({args.steps} steps each, same seed) ==")
    with tempfile.TemporaryDirectory(prefix="seal-bench-") as tmp:
        seal = run_recipe("seal", [], args.steps, Path(tmp))
        vanilla = run_recipe("vanilla", VANILLA_SWITCHES, args.steps, Path(tmp))
    print(f"{'part':<24}{'SEAL s':>10}{'vanilla s':>12}{'ratio':>8}")
    for part in PARTS:
        ratio = seal[part] / vanilla[part] if vanilla[part] else float("nan")
        print(f"{part:<24}{seal[part]:>10.3f}{vanilla[part]:>12.3f}{ratio:>8.3f}")
    print(f"step ratio SEAL / vanilla: {seal['timing_s/step'] / vanilla['timing_s/step']:.3f} (target <= 1.05)")
    share = seal["timing_s/seal_step"] / seal["timing_s/step"]
    print(
        f"SEAL's own work (diagnosis + A-Patch, inside update_actor): {seal['timing_s/seal_step']:.4f} s "
        f"= {100 * share:.3f} % of the SEAL step; the rest of the difference is the longer train-only prompts "
        "(schema cues) and machine noise"
    )


if __name__ == "__main__":
    main()

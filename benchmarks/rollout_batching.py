"""The ``hf`` CPU rollout server, batched vs one request at a time, measured in one run on this machine.

``actor_rollout_ref.rollout.max_num_seqs`` caps how many waiting requests the server generates together; 1 is
the one-at-a-time server. Three measurements, each printed as serial / batched:

1. **Server alone**: ``--requests`` requests of one ``--prompt-tokens`` prompt (GRPO's rollouts of one task share
   it), ``--max-tokens`` generated each, submitted together to an in-process server; wall time.
2. **A cpu_tiny step**: ``exp/cpu_tiny.yaml`` through the launcher (2 rollouts per step), mean ``timing_s/gen``
   and ``timing_s/step`` over its steps.
3. **The learning check**: ``scripts/learning_check.py`` (the normal run and its sign-flipped twin, 16 rollouts a
   step), wall time of each run, its generation time per step and its verdict.

    python benchmarks/rollout_batching.py                      # all three: ~40 min on 2 cores
    python benchmarks/rollout_batching.py --skip-learning      # 1 and 2: ~10 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.seal_overhead import run_recipe  # noqa: E402

SERIAL = "actor_rollout_ref.rollout.max_num_seqs=1"


def server_alone(requests: int, prompt_tokens: int, max_tokens: int) -> dict[str, float]:
    import torch

    from seal.cpu.hf_rollout import HFRolloutServer, HFServerConfig
    from seal.cpu.tiny_model import build_tiny_model

    model_dir = build_tiny_model(REPO / ".cache" / "tiny-qwen")
    prompt = torch.randint(1000, 100_000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True}
    seconds = {}
    for name, cap in (("serial", 1), ("batched", requests)):
        config = HFServerConfig(prompt_length=prompt_tokens, response_length=max_tokens, max_num_seqs=cap)
        server = HFRolloutServer(str(model_dir), config)
        server.generate_tokens(prompt[:8], {"max_tokens": 2})  # warm-up
        start = time.perf_counter()
        futures = [server.submit(prompt, params) for _ in range(requests)]
        assert all(len(f.result().token_ids) == max_tokens for f in futures)
        seconds[name] = time.perf_counter() - start
    return seconds


def learning_check(out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "learning_check.py"), "--out", str(out), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ}, capture_output=True, text=True)
    summary = json.loads((out / "learning_check.json").read_text())
    gen = {}
    for name in summary["wall_s"]:
        rows = [json.loads(line)["data"] for path in (out / name).glob("metrics_*.jsonl") for line in open(path)]
        gen[name] = statistics.mean(float(r["timing_s/gen"]) for r in rows if "timing_s/gen" in r)
    return {"wall_s": summary["wall_s"], "gen_s": gen, "passed": summary["passed"], "rc": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="cpu_tiny training steps per run")
    parser.add_argument("--skip-cpu-tiny", action="store_true")
    parser.add_argument("--skip-learning", action="store_true")
    args = parser.parse_args()

    print(
        f"== 1. server alone: {args.requests} requests x {args.prompt_tokens}-token prompt, {args.max_tokens} tokens =="
    )
    alone = server_alone(args.requests, args.prompt_tokens, args.max_tokens)
    print(f"serial {alone['serial']:.2f} s   batched {alone['batched']:.2f} s   "
          f"ratio serial / batched {alone['serial'] / alone['batched']:.2f}")  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="seal-bench-batching-") as tmp:
        if not args.skip_cpu_tiny:
            print(f"\n== 2. exp/cpu_tiny.yaml, {args.steps} steps each ==")
            runs = {"serial": run_recipe("serial", [SERIAL], args.steps, Path(tmp)),
                    "batched": run_recipe("batched", [], args.steps, Path(tmp))}  # fmt: skip
            for part in ("timing_s/gen", "timing_s/step"):
                s, b = runs["serial"][part], runs["batched"][part]
                print(f"{part:<16} serial {s:8.2f} s   batched {b:8.2f} s   ratio serial / batched {s / b:.2f}")
        if not args.skip_learning:
            print("\n== 3. scripts/learning_check.py (normal + flipped) ==")
            checks = {
                "serial": learning_check(Path(tmp) / "serial", [SERIAL]),
                "batched": learning_check(Path(tmp) / "batched", []),
            }
            for run in ("normal", "flipped"):
                s, b = (checks[k]["wall_s"][run] for k in ("serial", "batched"))
                gs, gb = (checks[k]["gen_s"][run] for k in ("serial", "batched"))
                print(f"{run:<8} wall serial {s:6.0f} s   batched {b:6.0f} s   ratio {s / b:.2f}    "
                      f"gen/step serial {gs:5.1f} s   batched {gb:5.1f} s   ratio {gs / gb:.2f}")  # fmt: skip
            total = {k: sum(c["wall_s"].values()) for k, c in checks.items()}
            print(f"both runs: serial {total['serial']:.0f} s, batched {total['batched']:.0f} s, "
                  f"ratio {total['serial'] / total['batched']:.2f}; verdicts: serial "
                  f"{'PASS' if checks['serial']['passed'] else 'FAIL'}, batched "
                  f"{'PASS' if checks['batched']['passed'] else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()

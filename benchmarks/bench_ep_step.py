"""The whole EP=2 tiny-model step with isolation vs the shared path (two GPUs, NCCL).

Runs the regression model (``fla_ac_isolation.harness.regression``: 4 blocks, hidden 512, 16 experts top-4,
torchtitan's MoE and all-to-all dispatcher, FLA kernels, bf16) for ``--steps`` AdamW steps per mode under
the torchtitan / prime-rl SAC rule (``save-d2h-copies``, under which the shared path runs), and prints the
median forward + backward time of the slowest rank per mode, skipping the first two steps (compilation,
and the data schedule's deliberately sparse step 1). Test-harness switches (FLA's #640 Hopper guard,
first-config autotuning) are applied through ``rank_setup`` (``testing.gpu.gpu_test_harness``) and printed
by the ranks.

    python -m benchmarks.bench_ep_step --steps 8 --json ep_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks import outcome


@outcome.stops_on_missing_module("bench_ep_step")
def main(argv=None) -> int:
    from fla_ac_isolation.harness.regression import RegressionSpec, run_regression
    from fla_ac_isolation.harness.testing.gpu import gpu_test_harness

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--model", default="qwen3_5_moe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--policy", default="save-d2h-copies")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        parser.error("needs 2 CUDA devices")
    spec = RegressionSpec(
        model=args.model, ep=2, steps=args.steps, ac="selective", policy=args.policy, backend="fla",
        device="cuda", dtype="bfloat16", hidden_size=512, num_experts=16, top_k=4, timeout_s=300,
        rank_setup=gpu_test_harness,
        modes=("no-ac", "shared", "isolated", "global-disable"),
    )
    result = run_regression(spec)
    rows = {}
    for name, mode in result.modes.items():
        timed = mode.step_seconds[2:]
        rows[name] = {
            "error": mode.error,
            "median_ms": statistics.median(timed) * 1e3 if timed else None,
            "steps_ms": [round(t * 1e3, 3) for t in mode.step_seconds],
        }
    shared = rows.get("shared", {}).get("median_ms")
    print(f"{'mode':16} {'median ms':>10} {'x shared':>9}  per-step ms")
    for name, row in rows.items():
        ratio = f"{row['median_ms'] / shared:.3f}" if shared and row["median_ms"] else "-"
        median = f"{row['median_ms']:.2f}" if row["median_ms"] else "-"
        print(f"{name:16} {median:>10} {ratio:>9}  {row['steps_ms']} {row['error'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": vars(args), "rows": rows, "notes": result.notes}, f, indent=1)
    return outcome.finish("bench_ep_step", outcome.by_mode(((n, r["error"]) for n, r in rows.items()), "modes"))


if __name__ == "__main__":
    raise SystemExit(main())

"""What replacing ``FLA_DISABLE_TENSOR_CACHE`` costs a trainer of its own: one training step (forward, recompute,
backward) of ``examples/own_trainer.py``'s model, fixed (``LayerLocalSeqlens``) under its SAC policy, against the
same model with FLA's cache disabled process-wide under the same policy, and without AC.

Modes (one model per mode, the same weights: the example's ``build(mode)``):

    no-ac           the model as shipped (one ``cu_seqlens`` for every layer), no checkpointing: the floor
    fixed           ``LayerLocalSeqlens`` once per forward, ``.local()`` in each layer; every decoder layer in
                    torch's ``checkpoint_wrapper`` under the example's ``sac_policy`` (every ``_to_copy``, ``mm``)
    global-disable  the model as shipped under the same SAC, ``fla.utils.FLA_DISABLE_TENSOR_CACHE = True`` during
                    this mode's steps only

Method: each iteration runs every mode once, in an order rotated by the iteration index (drift hits every mode
alike). Each step gets a new ``cu_seqlens`` object (3 rotating document layouts), made outside the timed region
as a loader does; the timed region is ``model(**batch)`` (``LayerLocalSeqlens``' construction included) and its
backward, between two CUDA events (``time.perf_counter`` on a CPU).

Columns: ``median_ms``, ``p10_ms``, ``p90_ms`` over ``--iters`` timed iterations after ``--warmup``;
``x_global`` (median over ``global-disable``'s median) and ``paired_x_global`` (median of per-iteration
ratios); ``peak_mib`` (one step's peak allocation above its start); ``syncs`` (host syncs of one step,
``torch.cuda.set_sync_debug_mode``); ``helpers`` (FLA index-helper computations of one step: cache misses and
bypasses); ``max_grad_diff`` (the largest ``|grad - no-ac grad|`` of one step from the same batch: 0 on a CPU; on
CUDA atomics, such as the MoE's ``index_add``, may leave a spread in every mode). ``--out`` writes JSON.

Run on one GPU (Qwen3.5-MoE's GDN widths; about a minute after compilation)::

    python -m benchmarks.bench_own_trainer --first-config --lift-hopper-guard --out own_trainer.json

``--device cpu`` is a smoke test of this script (tiny sizes, FLA's kernels served by ``reference_kernels()``,
one thread, memory and syncs 0), not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.layer_step import MIB, doc_lengths, elapsed_ms, fmt, paired_ratio, rotated

MODES = ("no-ac", "fixed", "global-disable")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_trainer.py"
NUM_LAYOUTS = 3  # rotating document layouts (and cu_seqlens objects) per run
#: --device cuda / cpu defaults: Qwen3.5-MoE's linear-attention widths at 4 layers, and the smoke test's
SIZES = {
    "cuda": dict(hidden=2048, layers=4, key_heads=16, value_heads=32, head_dim=128, experts=8, vocab=4096,
                 tokens=32768, docs=8, iters=20, warmup=3),
    "cpu": dict(hidden=64, layers=2, key_heads=2, value_heads=4, head_dim=16, experts=4, vocab=128,
                tokens=192, docs=3, iters=2, warmup=1),
}


@dataclass
class Row:
    mode: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    x_global: float
    paired_x_global: float
    peak_mib: float
    syncs: int
    helpers: int
    max_grad_diff: float
    times_ms: list[float] = field(default_factory=list)


def example():
    """``examples/own_trainer.py`` (loaded once per process, as ``check`` loads it)."""
    from fla_ac_isolation.harness.user_code import load_module

    return load_module(str(EXAMPLE))


def model_config(args: argparse.Namespace):
    return example().ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        linear_num_key_heads=args.key_heads, linear_num_value_heads=args.value_heads,
        linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim, num_experts=args.experts,
        moe_intermediate_size=args.hidden // 4)


class Run:
    """Every mode's model (one seed) and the rotating batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        own = example()
        self.device = torch.device(args.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        config = model_config(args)
        self.models = {mode: own.build(mode, config, seed=0).to(self.device, dtype) for mode in MODES}
        self.batches = [own.packed_batch(self.device, doc_lengths(args.tokens, args.docs, seed), args.vocab, seed)
                        for seed in range(NUM_LAYOUTS)]

    def step(self, mode: str, i: int):
        """Iteration ``i``'s step of ``mode``: a callable (forward and backward) on a new ``cu_seqlens``."""
        own, model = example(), self.models[mode]
        batch = dict(self.batches[i % NUM_LAYOUTS])
        batch["cu_seqlens"] = batch["cu_seqlens"].clone()  # a new object per step, as a loader's

        def run() -> None:
            model.zero_grad(set_to_none=True)
            with own.fla_cache_disabled(mode == "global-disable"):
                model(**batch).backward()

        return run

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def grads(self, mode: str) -> dict[str, torch.Tensor]:
        self.step(mode, 0)()
        return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.float() for n, p in
                self.models[mode].named_parameters()}


def peak_mib(run: Run, mode: str) -> float:
    if run.device.type != "cuda":
        run.step(mode, 1)()
        return 0.0
    step = run.step(mode, 1)
    run.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    run.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def probe(run: Run, mode: str) -> tuple[int, int]:
    """``(host syncs, FLA index-helper computations)`` of one untimed step of ``mode`` (syncs on CUDA only)."""
    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    step = run.step(mode, 2)
    run.synchronize()
    syncs = host_sync_sites() if run.device.type == "cuda" else contextlib.nullcontext([])
    with syncs as sites, probe_tensor_cache() as helpers:
        step()
    run.synchronize()
    return len(sites), helpers.misses + helpers.bypasses


def measure(args: argparse.Namespace) -> list[Row]:
    run = Run(args)
    for i in range(args.warmup):
        for mode in rotated(list(MODES), i):
            run.step(mode, i)()
    reference = run.grads("no-ac")
    diffs = {mode: max((g - reference[n]).abs().max().item() for n, g in run.grads(mode).items()) for mode in MODES}
    peaks = {mode: peak_mib(run, mode) for mode in MODES}
    probes = {mode: probe(run, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.iters):
        for mode in rotated(list(MODES), i):
            step = run.step(mode, i)
            run.synchronize()
            times[mode].append(elapsed_ms(run.device.type, step))
    rows = []
    for mode in MODES:
        median = statistics.median(times[mode])
        q = statistics.quantiles(times[mode], n=10, method="inclusive") if len(times[mode]) > 1 else [median]
        rows.append(Row(mode, median, q[0], q[-1], median / statistics.median(times["global-disable"]),
                        paired_ratio(times[mode], times["global-disable"]), peaks[mode], *probes[mode], diffs[mode],
                        times[mode]))
    return rows


def print_table(rows: list[Row], title: str) -> None:
    print(title)
    print(f"{'mode':<15} {'median ms':>10} {'p10':>9} {'p90':>9} {'x global':>9} {'paired':>7} {'peak MiB':>9} "
          f"{'syncs':>6} {'helpers':>8} {'max |grad - no-ac|':>19}")
    for r in rows:
        print(f"{r.mode:<15} {fmt(r.median_ms, '.2f'):>10} {fmt(r.p10_ms, '.2f'):>9} {fmt(r.p90_ms, '.2f'):>9} "
              f"{fmt(r.x_global, '.3f'):>9} {fmt(r.paired_x_global, '.3f'):>7} {fmt(r.peak_mib, '.0f'):>9} "
              f"{r.syncs:>6} {r.helpers:>8} {r.max_grad_diff:>19.3g}")


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    for name in SIZES["cuda"]:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {SIZES['cuda'][name]} on cuda, {SIZES['cpu'][name]} on cpu")
    parser.add_argument("--first-config", action="store_true", help="FLA's Triton autotuners keep their first config")
    parser.add_argument("--lift-hopper-guard", action="store_true",
                        help="lift FLA's #640 guard (Hopper, Triton < 3.7.1) for this process, saying so")
    parser.add_argument("--out", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu for the smoke test)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.device == "cpu":
            from fla_ac_isolation.harness.reference_kernels import reference_kernels

            prior = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, prior)
            stack.enter_context(reference_kernels())
        if args.first_config:
            from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config

            stack.enter_context(first_autotune_config())
        if args.lift_hopper_guard:
            from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

            stack.enter_context(lift_hopper_gdn_guard())
        rows = measure(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test, not a measurement)"
    print_table(rows, f"own trainer: {args.layers} x (Gated DeltaNet + MoE), hidden {args.hidden}, T = {args.tokens} "
                      f"({args.docs} documents), {'bfloat16' if args.device == 'cuda' else 'float32'}, {device}")
    if args.out:
        from fla_ac_isolation.harness.environment import versions

        Path(args.out).write_text(json.dumps({"args": vars(args), "device": device, "environment": versions(),
                                              "rows": [asdict(r) for r in rows]}, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What isolation costs: one GDN layer and one Mamba2 layer, forward + recompute + backward under SAC.

Modes (the same mixer and weights in each):

    no-ac            no checkpointing (the floor for time, the ceiling for memory)
    shared           SAC, one shared cu_seqlens object (the unsafe path; what models do today)
    isolated         SAC, LayerLocalSeqlens built from device offsets only (it hands every layer the host
                     copy its validation read, as cu_seqlens_cpu)
    isolated+cpu     SAC, LayerLocalSeqlens given cu_seqlens_cpu by the loader (validation compares
                     instead of copying; the layer step is the same)
    global-disable   SAC, shared cu_seqlens, FLA's tensor cache disabled process-wide

Each step builds new offsets (as a data loader does) outside the timed region; the timed region is one
layer's forward, its recompute and its backward. The SAC policy is torchtitan 0.3's op-level policy
(``policies.torchtitan_selective``). Per row: median ms over ``--iters`` timed steps after ``--warmup``
(CUDA events, inputs rotated over 3 buffers), spread (p10-p90), peak memory above the inputs, host
syncs per step (counted with ``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronising
call) and FLA index-helper computations per step (misses + bypasses, from ``fla_cache.probe_tensor_cache``).

Run on a CUDA machine::

    python benchmarks/bench_isolation.py --json bench.json --png bench.png

On Hopper with Triton < 3.7.1 FLA refuses the gated backward (its issue #640); ``--lift-hopper-guard``
sets FLA's flag for this process, printing so. Every mode runs the same kernels, so the comparison is fair.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import warnings
from dataclasses import asdict, dataclass

import torch

MODES = ("no-ac", "shared", "isolated", "isolated+cpu", "global-disable")


@dataclass
class Row:
    layer: str
    tokens: int
    docs: int
    mode: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    peak_mib: float
    syncs_per_step: int
    helper_computations_per_step: int
    sync_sites: dict[str, int]  # "file:line" of the Python code that triggered each host sync


def build_layer(kind: str, hidden: int, dtype: torch.dtype, device: str):
    if kind == "gdn":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        from fla_ac_isolation.mixers import Qwen3_5MoeGatedDeltaNet

        cfg = Qwen3_5MoeTextConfig(
            hidden_size=hidden, linear_num_key_heads=16, linear_num_value_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        )
        layer = Qwen3_5MoeGatedDeltaNet(cfg, layer_idx=0, backend="fla")
    elif kind == "mamba2":
        from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

        from fla_ac_isolation.mixers import NemotronHMamba2Mixer

        cfg = NemotronHConfig(
            hidden_size=hidden, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
            conv_kernel=4, expand=2, chunk_size=64,
        )
        layer = NemotronHMamba2Mixer(cfg, layer_idx=0, backend="fla")
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    return layer.to(device=device, dtype=dtype)


def doc_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, tokens, (docs - 1,), generator=g).tolist())
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def make_seqlens(mode: str, lens: list[int], device: str):
    from fla_ac_isolation.seqlens import LayerLocalSeqlens, SharedSeqlens

    host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = host.to(device)
    if mode == "isolated":
        return LayerLocalSeqlens(cu)
    if mode == "isolated+cpu":
        return LayerLocalSeqlens(cu, cu_seqlens_cpu=host)
    return SharedSeqlens(cu)  # no-ac, shared, global-disable: one object, as models pass it


def run_mode(kind: str, mode: str, tokens: int, docs: int, args) -> Row:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from fla_ac_isolation.fla_cache import probe_tensor_cache, tensor_cache_disabled
    from fla_ac_isolation.policies import sac_context_fn, torchtitan_selective

    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    layer = build_layer(kind, args.hidden, dtype, device)
    if mode != "no-ac":
        layer = checkpoint_wrapper(
            layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=sac_context_fn(torchtitan_selective())
        )
    inputs = [torch.randn(1, tokens, args.hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(1, tokens, args.hidden, device=device, dtype=dtype)
    lens = [doc_lengths(tokens, docs, seed) for seed in range(3)]
    cache_ctx = tensor_cache_disabled if mode == "global-disable" else contextlib.nullcontext

    def step(i: int) -> None:
        x = inputs[i % 3]
        seqlens = step.seqlens[i % 3]
        out = layer(x, seqlens=seqlens)
        out.backward(grad_out)
        x.grad = None

    def fresh_seqlens():
        step.seqlens = [make_seqlens(mode, lens[j], device) for j in range(3)]

    with cache_ctx():
        for i in range(args.warmup):
            fresh_seqlens()
            step(i)
        torch.cuda.synchronize()
        # host syncs and helper computations of one step (not timed)
        fresh_seqlens()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, probe_tensor_cache() as probe:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sync_warnings = [w for w in caught if "synchroniz" in str(w.message)]
        syncs = len(sync_warnings)
        sites: dict[str, int] = {}
        for w in sync_warnings:
            key = f"{w.filename.split('site-packages/')[-1]}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
        computations = probe.misses + probe.bypasses
        # peak memory of one step above what is allocated before it
        torch.cuda.synchronize()
        fresh_seqlens()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(1)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        # timing
        times = []
        for i in range(args.iters):
            fresh_seqlens()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            step(i)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    q = statistics.quantiles(times, n=10)
    return Row(kind, tokens, docs, mode, statistics.median(times), q[0], q[-1], peak, syncs, computations, sites)


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="isolation cost per layer step (forward + recompute + backward), bf16")
    for col in ("layer", "T", "mode", "median ms", "p10-p90 ms", "x shared", "peak MiB", "d peak vs shared MiB",
                "syncs/step", "helper computations/step"):
        table.add_column(col, justify="right")
    for row in rows:
        shared = next(r for r in rows if r.layer == row.layer and r.tokens == row.tokens and r.mode == "shared")
        table.add_row(
            row.layer, str(row.tokens), row.mode, f"{row.median_ms:.3f}", f"{row.p10_ms:.3f}-{row.p90_ms:.3f}",
            f"{row.median_ms / shared.median_ms:.3f}", f"{row.peak_mib:.1f}", f"{row.peak_mib - shared.peak_mib:+.2f}",
            str(row.syncs_per_step), str(row.helper_computations_per_step),
        )
    Console(width=200).print(table)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.layer, r.tokens) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (layer, tokens) in zip(axes[0], groups):
        sub = [r for r in rows if r.layer == layer and r.tokens == tokens]
        ax.bar([r.mode for r in sub], [r.median_ms for r in sub], color=["#999", "#e63946", "#2a9d8f", "#52b788", "#f4a261"])
        ax.set_title(f"{layer}, T={tokens}")
        ax.set_ylabel("median ms / step")
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", default=["gdn", "mamba2"], choices=["gdn", "mamba2"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--lift-hopper-guard", action="store_true")
    parser.add_argument("--first-config", action="store_true",
                        help="skip Triton autotuning (first config of each kernel; same kernels in every mode)")
    parser.add_argument("--where-syncs", action="store_true", help="print where each host sync was triggered")
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device")
    from fla_ac_isolation.testing.autotune import first_autotune_config
    from fla_ac_isolation.testing.gpu import lift_hopper_gdn_guard

    rows = []
    with (
        lift_hopper_gdn_guard() if args.lift_hopper_guard else contextlib.nullcontext(),
        first_autotune_config() if args.first_config else contextlib.nullcontext(),
    ):
        for kind in args.layers:
            for tokens in args.tokens:
                for mode in args.modes:
                    row = run_mode(kind, mode, tokens, args.docs, args)
                    print(f"{kind} T={tokens} {mode}: {row.median_ms:.3f} ms, {row.syncs_per_step} syncs, "
                          f"{row.helper_computations_per_step} helper computations", flush=True)
                    rows.append(row)
    meta = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "hidden": args.hidden, "iters": args.iters, "warmup": args.warmup, "first_config": args.first_config,
        "hopper_guard_lifted": args.lift_hopper_guard,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.png:
        plot(rows, args.png)
    print_table(rows)
    if args.where_syncs:
        for row in rows:
            print(f"sync sites {row.layer} T={row.tokens} {row.mode}: {row.sync_sites}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

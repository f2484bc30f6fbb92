"""What ``policies.save_fla_ops`` keeps per layer: the outputs of each saveable FLA operator, in MiB.

The sizes are those of the ``fla`` backend's custom operators (``ops.saveable``; kernels in
``fla_seam.saveable_kernels``) at the benchmark's layer shapes (``harness.layer_widths.layer_fields``), in bf16:
each operator's fake kernel is run under ``FakeTensorMode`` on inputs shaped as the mixer hands them, so
nothing is allocated and no GPU is needed.
They are exact: a checkpointed layer under ``save_fla_ops(ops)`` holds these tensors, and only these, from
its forward to its backward (more than without saving; the step's peak, set in the backward, need not move).

    python -m benchmarks.saved_outputs                 # the two tables of docs/benchmarks.md
    python -m benchmarks.saved_outputs --tokens 8192 --hidden 1024
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import outcome
from fla_ac_isolation.harness.layer_widths import layer_fields

MIB = 2**20
OPERATIONS = ("gated_delta_rule", "ssd", "causal_conv1d")  # the names save_fla_ops takes
CORE = {"gdn": "gated_delta_rule", "mamba2": "ssd"}


def output_bytes(kind: str, tokens: int, hidden: int) -> dict[str, dict[str, int]]:
    """``{operation: {output name: bytes}}`` of one ``kind`` layer (``gdn`` | ``mamba2``) on ``tokens`` packed tokens.

    Raises:
        ValueError: ``kind`` or ``hidden`` not accepted by :func:`fla_ac_isolation.harness.layer_widths.layer_fields`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fla_ac_isolation.ops.saveable  # noqa: F401  (registers the operators)

    fields = layer_fields(kind, hidden)
    ops, bf16 = torch.ops.fla_ac_isolation, torch.bfloat16
    with FakeTensorMode():
        cu = torch.tensor([0, tokens], dtype=torch.int32)
        if kind == "gdn":
            heads, k_dim = fields["linear_num_key_heads"], fields["linear_key_head_dim"]
            v_heads, v_dim = fields["linear_num_value_heads"], fields["linear_value_head_dim"]
            channels = 2 * heads * k_dim + v_heads * v_dim
            q = k = torch.empty(1, tokens, heads, k_dim, dtype=bf16)
            v = torch.empty(1, tokens, v_heads, v_dim, dtype=bf16)
            g, beta = torch.empty(1, tokens, v_heads), torch.empty(1, tokens, v_heads, dtype=bf16)
            core = dict(zip(("o", "A", "g_cumsum", "q_rstd", "k_rstd"),
                            ops.gated_delta_rule(q, k, v, g, beta, k_dim**-0.5, True, cu, cu, None)))
        else:
            heads, p_dim = fields["mamba_num_heads"], fields["mamba_head_dim"]
            groups, state = fields["n_groups"], fields["ssm_state_size"]
            channels = heads * p_dim + 2 * groups * state
            c = b = torch.empty(1, tokens, groups, state, dtype=bf16)
            v, g = torch.empty(1, tokens, heads, p_dim, dtype=bf16), torch.empty(1, tokens, heads)
            core = dict(zip(("o", "g_cumsum"), ops.simple_gla(c, b, v, g, 1.0, cu, cu, None, None)))
        x = torch.empty(1, tokens, channels, dtype=bf16)
        conv = {"y": ops.causal_conv1d(x, torch.empty(channels, 4, dtype=bf16), None, "silu", cu, cu, None)}
    nbytes = {name: t.numel() * t.element_size() for name, t in core.items()}
    return {CORE[kind]: nbytes, "causal_conv1d": {"y": conv["y"].numel() * conv["y"].element_size()}}


def saved_mib(kind: str, tokens: int, hidden: int, operations: tuple[str, ...]) -> float:
    """MiB a ``kind`` layer keeps under ``save_fla_ops(operations)`` (operations it does not run count 0)."""
    sizes = output_bytes(kind, tokens, hidden)
    return sum(sum(sizes[op].values()) for op in operations if op in sizes) / MIB


def table(tokens: list[int], hidden: int) -> str:
    """The markdown table of docs/benchmarks.md: MiB kept per operation and layer, one column per ``T``."""
    columns = " | ".join(f"T = {t}" for t in tokens)
    lines = [f"| layer | operation (`save_fla_ops` name) | outputs kept | {columns} |",
             "|---|---|---|" + "---|" * len(tokens)]
    for kind, label in (("gdn", "GDN"), ("mamba2", "Mamba2")):
        per_t = [output_bytes(kind, t, hidden) for t in tokens]
        for op in (CORE[kind], "causal_conv1d"):
            parts = ", ".join(per_t[0][op])
            cells = " | ".join(f"{sum(sizes[op].values()) / MIB:.0f}" for sizes in per_t)
            lines.append(f"| {label} | `{op}` | {parts} | {cells} |")
    return "\n".join(lines)


def totals_table(tokens: list[int], hidden: int, layers: list[int]) -> str:
    """GiB a model keeps under each saveable mode: the per-layer MiB times ``L`` layers of one kind."""
    modes = (("save-core", 1), ("save-core+conv", 2))
    header = " | ".join(f"T = {t}, L = {n}" for t in tokens for n in layers)
    lines = [f"| layers | mode | {header} |", "|---|---|" + "---|" * (len(tokens) * len(layers))]
    for kind, label in (("gdn", "GDN"), ("mamba2", "Mamba2")):
        for mode, count in modes:
            operations = (CORE[kind], "causal_conv1d")[:count]
            per_layer = {t: saved_mib(kind, t, hidden, operations) for t in tokens}
            cells = " | ".join(f"{per_layer[t] * n / 1024:.1f}" for t in tokens for n in layers)
            lines.append(f"| {label} | `isolated+{mode}` | {cells} |")
    return "\n".join(lines)


@outcome.stops_on_missing_module("saved_outputs")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=outcome.EPILOG)
    parser.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072],
                        help="packed tokens per layer call (per GPU), one table column each")
    parser.add_argument(
        "--hidden", type=int, default=2048,
        help="model width D; the heads follow it as in harness.layer_widths.layer_fields: GDN head dims "
             "K = V = min(128, D/4) with D/K key heads and as many value heads; Mamba2 head dim P = min(64, D/4), "
             "H = 2D/P heads, min(8, H) groups, state min(128, D) (default 2048: GDN 16 heads of 128, Mamba2 64 "
             "heads of 64). Other head layouts: use the per-token formulas of docs/benchmarks.md",
    )
    parser.add_argument("--layers", nargs="+", type=int, default=[24, 48],
                        help="numbers of linear-attention layers for the per-model totals (GiB)")
    args = parser.parse_args(argv)
    print(table(args.tokens, args.hidden))
    print()
    print(totals_table(args.tokens, args.hidden, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

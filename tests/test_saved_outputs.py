"""The memory side of the saveable ops: benchmarks/saved_outputs.py against shape formulas, and the docs' tables.

The script runs the ``fla`` operators' fake kernels at the benchmark's layer shapes; here the same sizes
come from the shapes by hand (bytes per token and layer), and docs/benchmarks.md must show the script's
output verbatim.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.fixture(scope="module")
def saved_outputs():
    from benchmarks import saved_outputs

    return saved_outputs


@pytest.mark.parametrize("tokens", [32768, 131072, 100])
def test_sizes_equal_bytes_per_token_from_the_shapes(saved_outputs, tokens):
    """Hidden 2048: GDN H = HV = 16 heads of K = V = 128 (conv channels 6144); Mamba2 64 heads of P = 64,
    8 groups of N = 128 (conv channels 4096 + 2048). bf16 outputs, fp32 cumsums and norms."""
    heads, v_dim = 16, 128
    gdn = saved_outputs.output_bytes("gdn", tokens, 2048)
    assert gdn["gated_delta_rule"] == {
        "o": tokens * heads * v_dim * 2, "A": tokens * heads * 64 * 2, "g_cumsum": tokens * heads * 4,
        "q_rstd": tokens * heads * 4, "k_rstd": tokens * heads * 4}
    assert gdn["causal_conv1d"] == {"y": tokens * 6144 * 2}
    mamba2 = saved_outputs.output_bytes("mamba2", tokens, 2048)
    assert mamba2 == {"ssd": {"o": tokens * 64 * 64 * 2, "g_cumsum": tokens * 64 * 4},
                      "causal_conv1d": {"y": tokens * (4096 + 2 * 8 * 128) * 2}}
    per_token = 2 * 16 * (128 + 64) + 4 * 16 + 8 * 16  # the docs' formula for the GDN core
    assert saved_outputs.saved_mib("gdn", tokens, 2048, ("gated_delta_rule",)) == per_token * tokens / MIB
    assert saved_outputs.saved_mib("mamba2", tokens, 2048, ("gated_delta_rule", "ssd")) == (
        (2 * 64 * 64 + 4 * 64) * tokens / MIB)


def test_docs_show_the_scripts_tables(saved_outputs):
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert saved_outputs.table([32768, 131072], 2048) in docs
    assert saved_outputs.totals_table([32768, 131072], 2048, [24, 48]) in docs


def test_docs_saved_column_of_the_h200_table_is_computed_and_equals_the_measured_extra_memory(saved_outputs):
    """The H200 table's "saved MiB" column comes from the shapes; its measured held-memory delta over
    ``isolated`` (in brackets) equals it: no hidden copies."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(
        r"^\| (gdn|mamba2) \| (\d+) \| (isolated\+save-core(?:\+conv)?) \|(?: [^|]+ \|){3} \d+ \(\+(\d+)\) \| (\d+) \| \d+ \|$",
        docs, re.M,
    )
    assert len(rows) == 8
    ops = {"isolated+save-core": ("gated_delta_rule", "ssd"),
           "isolated+save-core+conv": ("gated_delta_rule", "ssd", "causal_conv1d")}
    for layer, tokens, mode, held_delta, mib in rows:
        assert int(mib) == round(saved_outputs.saved_mib(layer, int(tokens), 2048, ops[mode])), (layer, tokens, mode)
        assert int(held_delta) == int(mib), (layer, tokens, mode)

"""reference_kernels(): FLA's kernels served to foreign code wherever it looks them up, and restored.

Where foreign code finds FLA (fla-core 0.6): package attributes (OLMo-core imports them inside its dispatch
functions), FLA's synthesised alias modules (``fla.modules.convolution`` is a copy, not a re-export), a
binding made at import (torchtitan's ``_fla_chunk_gated_delta_rule``), the closure cell of transformers'
kernel wrapper, and ``FusedRMSNormGated.forward`` on the class.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest
import torch
from helpers import olmo_hybrid

from fla_ac_isolation.harness.reference_kernels import reference_kernels

pytestmark = pytest.mark.usefixtures("single_thread")


def _bindings() -> dict[str, object]:
    """Every place checked, with what it holds now."""
    import fla.modules.convolution as conv_alias
    import fla.ops.gated_delta_rule as gdn_package
    import fla.ops.kda as kda_package
    import torchtitan.models.qwen3_5.model as titan
    from fla.modules import FusedRMSNormGated
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    conv_ops = importlib.import_module("fla.modules.conv.causal_conv1d")  # torchtitan's: FLA's ops module
    cell = inspect.getclosurevars(hf.torch_chunk_gated_delta_rule).nonlocals["implementation"]
    return {
        "fla.ops.gated_delta_rule.chunk_gated_delta_rule": gdn_package.chunk_gated_delta_rule,
        "fla.ops.kda.chunk_kda": kda_package.chunk_kda,
        "fla.modules.convolution.causal_conv1d": conv_alias.causal_conv1d,
        "fla.modules.conv.causal_conv1d.causal_conv1d": conv_ops.causal_conv1d,
        "torchtitan._fla_chunk_gated_delta_rule": titan._fla_chunk_gated_delta_rule,
        "transformers closure": cell,
        "FusedRMSNormGated.forward": FusedRMSNormGated.__dict__["forward"],
    }


def test_every_lookup_is_served_inside_and_restored_on_exit_even_after_an_error():
    before = _bindings()
    fla_functions = {v.__module__ + "." + v.__qualname__ for v in before.values()}
    assert "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule" in fla_functions

    with pytest.raises(KeyError, match="raised inside"), reference_kernels() as served:
        inside = _bindings()
        late = types.ModuleType("imported_inside_the_block")  # binds whatever FLA's package holds now
        late.chunk = inside["fla.ops.gated_delta_rule.chunk_gated_delta_rule"]
        sys.modules[late.__name__] = late
        raise KeyError("raised inside")

    try:
        assert all(inside[k] is not before[k] for k in before), [k for k in before if inside[k] is before[k]]
        assert {f"{v.__module__}.{v.__name__}" for v in inside.values()} <= {
            f"fla_ac_isolation.harness.fla_seam.served_ops.{name}"
            for name in ("chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "rms_norm_gated_forward")
        }
        assert "closure of transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.torch_chunk_gated_delta_rule" \
            in served.places
        assert _bindings() == before  # every binding holds FLA's object again
        assert late.chunk is before["fla.ops.gated_delta_rule.chunk_gated_delta_rule"]
    finally:
        del sys.modules["imported_inside_the_block"]

    with reference_kernels():  # and a second block serves again
        assert _bindings()["transformers closure"] is inside["transformers closure"]


def test_served_kernels_keep_packed_documents_apart_in_olmo_cores_gated_deltanet():
    """OLMo-core's GDN hands cu_doc_lens to three FLA convs and FLA's gated delta rule (float64)."""
    gdn = olmo_hybrid(("gdn",)).blocks["0"].attention.double()
    x = torch.randn(1, 48, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 20, 29, 48], dtype=torch.int32)
    with torch.no_grad(), reference_kernels() as served:
        packed = gdn(x, cu_doc_lens=cu)
        one_row = gdn(x)  # the control: no offsets, the three documents are one sequence
        alone = torch.cat([gdn(x[:, a:b]) for a, b in ((0, 20), (20, 29), (29, 48))], dim=1)

    assert [c.kernel for c in served.calls[:4]] == ["causal_conv1d"] * 3 + ["chunk_gated_delta_rule"]
    assert all(c.cu_seqlens is cu for c in served.calls[:4])  # as shipped: the caller's object itself
    assert (packed - alone).abs().max().item() < 1e-12  # measured 2.6e-18
    assert (one_row - alone).abs().max().item() > 1e-3  # measured 8.6e-3, on outputs of at most 1.0e-2

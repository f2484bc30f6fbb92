"""reference_kernels(): FLA's kernels served to foreign code wherever it looks them up, and restored.

Where foreign code finds FLA (fla-core 0.6): package attributes (OLMo-core imports them inside its dispatch
functions), FLA's synthesised alias modules (``fla.modules.convolution`` is a copy, not a re-export), a
binding made at import (torchtitan's ``_fla_chunk_gated_delta_rule``), transformers' kernel functions (the
closure cell of its wrapper without the ``kernels`` package, up to 5.24; with it, from 5.25, its function module
kernelized to the stand-in), and ``FusedRMSNormGated.forward`` on the class. On exit each holds FLA's object again, behind
one guard per entry point (repeated blocks never stack them): a region checkpointed inside the block whose
backward runs after it recomputes through the guard, which names the fix instead of torch's SAC storage error.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest
import torch
from helpers import olmo_hybrid

from fla_ac_isolation.harness.fla_seam import serving
from fla_ac_isolation.harness.foreign_models import build_tiny
from fla_ac_isolation.harness.reference_kernels import reference_kernels
from fla_ac_isolation.harness.transformers_kernels import hub_name, implementation_cell
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

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
    found = {}
    if implementation_cell(hf.torch_chunk_gated_delta_rule) is not None:  # transformers <= 5.24 without kernels
        found["transformers closure"] = inspect.getclosurevars(hf.torch_chunk_gated_delta_rule).nonlocals[
            "implementation"]
    return {**found,
        "fla.ops.gated_delta_rule.chunk_gated_delta_rule": gdn_package.chunk_gated_delta_rule,
        "fla.ops.kda.chunk_kda": kda_package.chunk_kda,
        "fla.modules.convolution.causal_conv1d": conv_alias.causal_conv1d,
        "fla.modules.conv.causal_conv1d.causal_conv1d": conv_ops.causal_conv1d,
        "torchtitan._fla_chunk_gated_delta_rule": titan._fla_chunk_gated_delta_rule,
        "FusedRMSNormGated.forward": FusedRMSNormGated.__dict__["forward"],
    }


def _fla_objects(bindings: dict[str, object]) -> dict[str, object]:
    """FLA's own objects (a binding held before any block, or behind the guard a block put back)."""
    return {k: getattr(v, "fla_entry_point", v) for k, v in bindings.items()}


def test_every_lookup_is_served_inside_and_restored_on_exit_even_after_an_error():
    before = _bindings()
    fla = _fla_objects(before)
    fla_functions = {v.__module__ + "." + v.__qualname__ for v in fla.values()}
    assert "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule" in fla_functions

    hf_function = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
                                          ).torch_chunk_gated_delta_rule
    kernelized = hub_name(hf_function) is not None  # transformers >= 5.25 (or `kernels` installed)
    assert kernelized == (implementation_cell(hf_function) is None)
    with pytest.raises(KeyError, match="raised inside"), reference_kernels() as served:
        inside = _bindings()
        forward_inside = vars(hf_function).get("forward")
        # only bindings of FLA's objects are replaced: no other library's wrapper (an empty closure cell once
        # matched the recurrent entry points' lookup, which gave every torch wrapper an adapter)
        foreign = [p for p in served.places if p.startswith(("closure of torch.", "torch."))]
        assert foreign == []
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
        hf_place = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.torch_chunk_gated_delta_rule"
        if kernelized:  # its forward ran the stand-in inside, its own one again after
            assert f"kernelized {hf_place}" in served.places and f"closure of {hf_place}" not in served.places
            assert forward_inside.__func__.__module__ == "fla_ac_isolation.harness.transformers_kernels"
            assert "forward" not in vars(hf_function)
        else:
            assert f"closure of {hf_place}" in served.places and f"kernelized {hf_place}" not in served.places
            assert forward_inside is None
        after = _bindings()
        # every binding holds FLA's object again, behind its guard (functools.wraps: __wrapped__ is FLA's)
        assert all(after[k].fla_entry_point is fla[k] and after[k].__wrapped__ is fla[k] for k in fla), after
        assert all(after[k] is not fla[k] for k in fla)
        assert late.chunk is after["fla.ops.gated_delta_rule.chunk_gated_delta_rule"]
    finally:
        del sys.modules["imported_inside_the_block"]

    with reference_kernels():  # and a second block serves again
        assert _bindings() == inside
    assert _bindings() == after  # the same guards: not stacked
    with reference_kernels(), reference_kernels():  # nested blocks: the inner one leaves the stand-ins
        assert _bindings() == inside
    assert _bindings() == after


def test_served_kernels_keep_packed_documents_apart_in_olmo_cores_gated_deltanet():
    """OLMo-core's GDN hands cu_doc_lens to three FLA convs and FLA's gated delta rule (float64)."""
    pytest.importorskip("olmo_core", reason="OLMo-core needs torch < 2.14: not on CI's latest stack")
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


# ------------------------------------------------- a checkpointed region's backward outside the block
def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}


def _sac_model():
    """FLA's tiny GatedDeltaNetForCausalLM, every layer checkpointed under SAC (save every ``_to_copy``)."""
    model, batch, _ = build_tiny("gated_deltanet")
    checkpoint_layers(model, "selective", save_all_copies())
    return model, batch


BACKWARD_OUTSIDE = ("FLA's {} was called on CPU tensors outside reference_kernels(): a region checkpointed inside "
                    "reference_kernels() recomputes in backward; run backward inside the `with reference_kernels():` "
                    "block")


def test_inside_the_block_the_checkpointed_step_is_bit_exact_to_no_ac():
    with reference_kernels():
        plain, batch, _ = build_tiny("gated_deltanet")
        want = _step(plain, batch)
        got = _step(*_sac_model())
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in want[1])


def test_a_backward_outside_the_block_is_told_to_run_inside_it_before_any_op_of_flas():
    model, batch = _sac_model()
    with reference_kernels():
        loss = model(**batch).loss
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert str(info.value) == BACKWARD_OUTSIDE.format("RMSNorm.forward")  # the layers' first FLA call


def test_the_unsafe_path_without_the_guard_fails_in_sacs_storage_lookup(monkeypatch):
    """Bindings put back to FLA's own objects (as before the guard): the recompute reaches FLA's RMSNorm, whose
    first op (``empty_like``) the forward of the served stand-in never ran (torch 2.13 and 2.15's text)."""
    monkeypatch.setattr(serving, "_guarded", lambda fla, name=None: getattr(fla, "fla_entry_point", fla))
    model, batch = _sac_model()
    with reference_kernels():
        loss = model(**batch).loss
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert str(info.value) == (
        "aten.empty_like.default encountered during backward but not found in storage. This can happen if the "
        "operations in the checkpointed region are nondeterministic or depend on global state that changed between "
        "forward and backward.")


def test_fla_called_on_a_cpu_outside_any_backward_is_told_to_use_the_block():
    from fla.modules import RMSNorm

    with reference_kernels():
        pass
    with pytest.raises(RuntimeError) as info:
        RMSNorm(8)(torch.ones(2, 8))
    assert str(info.value) == ("FLA's RMSNorm.forward was called on CPU tensors outside reference_kernels(): FLA's "
                               "Triton kernels cannot run on a CPU; call it inside a `with reference_kernels():` "
                               "block (or on CUDA tensors)")


def test_served_chunk_kda_asks_flas_index_helper_by_keyword_as_the_kernel_does():
    """FLA's ``tensor_cache`` (fla-core 0.6, ``fla/utils/decorators.py``) reuses an entry only for a call with the
    same number of positional arguments, the same keyword names and the same objects. ``chunk_kda``'s forward asks
    ``prepare_chunk_indices(cu_seqlens=, chunk_size=, cu_seqlens_cpu=)`` by keyword, FLA's conv (and our layout
    helper) positionally: after the conv's lookup for one ``cu_seqlens`` object the kernel misses, so the served
    ``chunk_kda`` must miss too, then hit its own entry on the next call. The positional lookup the stand-in made
    before hits the conv's entry instead, and FLA's cache would then differ from the kernel's."""
    import fla.ops.kda as kda_package

    from fla_ac_isolation.fla_seam.cache import probe_tensor_cache
    from fla_ac_isolation.fla_seam.layout import prepare_chunk_indices
    from fla_ac_isolation.seqlens import LayerLocalSeqlens

    local = LayerLocalSeqlens.from_seq_lens([5, 70, 3]).local()
    varlen = dict(cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 78, 2, 8, generator=gen), torch.randn(1, 78, 2, 8, generator=gen)
    v, g = torch.randn(1, 78, 2, 4, generator=gen), -torch.rand(1, 78, 2, 8, generator=gen)
    beta = torch.rand(1, 78, 2, generator=gen)

    def lookups(probe):
        return [e.outcome for e in probe.events if e.helper == "prepare_chunk_indices"]

    with reference_kernels() as served, probe_tensor_cache() as probe:
        prepare_chunk_indices(local.cu_seqlens, 64, cu_seqlens_cpu=local.cu_seqlens_cpu)  # the conv's lookup
        kda_package.chunk_kda(q, k, v, g, beta, **varlen)
        kda_package.chunk_kda(q, k, v, g, beta, **varlen)
    assert [call.kernel for call in served.calls] == ["chunk_kda", "chunk_kda"]
    assert lookups(probe) == ["miss", "miss", "hit"]

    # the unsafe form: the same lookup positionally (the stand-in's old call) is the conv's entry, a hit
    other = LayerLocalSeqlens.from_seq_lens([5, 70, 3]).local()
    with probe_tensor_cache() as probe:
        conv = prepare_chunk_indices(other.cu_seqlens, 64, cu_seqlens_cpu=other.cu_seqlens_cpu)
        positional = prepare_chunk_indices(other.cu_seqlens, 64, cu_seqlens_cpu=other.cu_seqlens_cpu)
    assert lookups(probe) == ["miss", "hit"] and positional is conv


# ------------------------------------------------------------- imports executed inside the block
# A user's forward importing FLA's op where it calls it: the three import forms. Each returns the object it
# imported and its output; the offsets object is handed on as it is (the stand-in records it).
def _gdn_from_package(x, cu):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule, chunk_gated_delta_rule(*x, cu_seqlens=cu)[0]


def _gdn_from_its_module(x, cu):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule

    return chunk_gated_delta_rule, chunk_gated_delta_rule(*x, cu_seqlens=cu)[0]


def _conv_from_flas_alias(x, cu):
    from fla.modules.conv import causal_conv1d  # fla.modules synthesises fla.modules.conv at its own import

    return causal_conv1d, causal_conv1d(x[2].flatten(-2), torch.ones(8, 4), cu_seqlens=cu)[0]


# (the function, the package removed from sys.modules inside the block, the kernel, the module defining FLA's op)
IMPORT_FORMS = {
    "from fla.ops.gated_delta_rule": (_gdn_from_package, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                                      "fla.ops.gated_delta_rule.chunk"),
    "from fla.ops.gated_delta_rule.chunk": (_gdn_from_its_module, "fla.ops.gated_delta_rule.chunk",
                                            "chunk_gated_delta_rule", "fla.ops.gated_delta_rule.chunk"),
    "from fla.modules.conv": (_conv_from_flas_alias, "fla.modules", "causal_conv1d",
                              "fla.modules.causal_conv1d.ops"),
}


def _gdn_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 12, 2, 8, generator=gen), torch.randn(1, 12, 2, 8, generator=gen)
    v, g, beta = torch.randn(1, 12, 2, 4, generator=gen), -torch.rand(1, 12, 2, generator=gen), torch.rand(1, 12, 2)
    return q, k, v, g, beta


def _import_anew(monkeypatch, package: str) -> None:
    """Remove ``package`` and its submodules from ``sys.modules`` (and its parent's attribute), so that the next
    import executes them anew: FLA's op is then a new function object; the old modules come back after the test."""
    parent, _, child = package.rpartition(".")
    monkeypatch.setattr(sys.modules[parent], child, getattr(sys.modules[parent], child))
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("form", list(IMPORT_FORMS), ids=list(IMPORT_FORMS))
def test_an_import_inside_the_block_gets_the_stand_in_even_when_its_module_is_first_imported_there(monkeypatch,
                                                                                                      form):
    from fla_ac_isolation.harness.fla_seam import served_ops
    from fla_ac_isolation.harness.fla_seam.served_ops import KernelCall

    call, package, kernel, defining = IMPORT_FORMS[form]
    x, cu = _gdn_inputs(), torch.tensor([0, 5, 12], dtype=torch.int32)
    before = sys.modules[defining]
    with reference_kernels() as served:
        _import_anew(monkeypatch, package)
        op, out = call(x, cu)
        module = sys.modules[defining]
    assert module is not before  # executed anew inside the block: FLA's op there is a new object
    assert op is getattr(served_ops, kernel) and out.shape[1] == 12
    assert served.calls == [KernelCall(kernel, cu, None, None)]
    assert f"{defining}.{kernel}" in served.places

    # after the block: the module binds its own (new) FLA function again, behind the guard
    assert getattr(module, kernel).fla_entry_point is not getattr(before, kernel).fla_entry_point
    with pytest.raises(RuntimeError) as info:
        call(x, cu)
    assert str(info.value) == (f"FLA's {kernel} was called on CPU tensors outside reference_kernels(): FLA's Triton "
                               f"kernels cannot run on a CPU; call it inside a `with reference_kernels():` block (or "
                               f"on CUDA tensors)")


@pytest.mark.parametrize("form", list(IMPORT_FORMS), ids=list(IMPORT_FORMS))
def test_without_serving_what_is_imported_inside_the_block_fla_runs_its_triton_kernel(monkeypatch, form):
    """The unsafe path (the block as it was: the namespaces present at entry only): the import inside executes
    FLA's module anew and binds its new function, which the block never saw; Triton finds no GPU."""
    monkeypatch.setattr(serving._Serving, "loaded", lambda self, module: None)
    call, package, _, _ = IMPORT_FORMS[form]
    with reference_kernels() as served:
        _import_anew(monkeypatch, package)
        with pytest.raises(RuntimeError) as info:
            call(_gdn_inputs(), torch.tensor([0, 5, 12], dtype=torch.int32))
    assert str(info.value) == "0 active drivers ([]). There should only be one."
    assert served.calls == []


def test_a_64_token_schedule_handed_with_another_chunk_size_is_refused_naming_both():
    """A user's own code calling FLA's ops with ``chunk_size=32`` and ``LayerLocalSeqlens.local()``'s 64-token
    ``chunk_indices``: FLA's kernels read the wrong rows (overflow, then NaN, under Triton's interpreter: a fresh
    user's trial); the served stand-ins refuse it instead of computing right on a CPU. Without the schedule, or with
    chunk_size=64, the call runs."""
    from fla_ac_isolation import LayerLocalSeqlens

    local = LayerLocalSeqlens.from_seq_lens([37, 50, 41]).local()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 16, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 128, 2, generator=gen), torch.rand(1, 128, 2, generator=gen)
    varlen = dict(cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu)
    with reference_kernels():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # served: imported inside the block

        with pytest.raises(ValueError) as info:
            chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, chunk_indices=local.chunk_indices, **varlen)
        at_64, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, chunk_indices=local.chunk_indices, **varlen)
        at_32, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, **varlen)
    assert str(info.value) == (
        "chunk_gated_delta_rule: chunk_indices has 3 rows but chunk_size=32 makes 6 chunks of these documents: the "
        "schedule was built for another chunk size (LayerLocalSeqlens.local() builds FLA's 64-token one); pass "
        "chunk_size=64, or no chunk_indices")
    assert torch.equal(at_64, at_32)  # the reference computes by document, whatever the chunk size

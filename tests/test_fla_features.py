"""What the installed FLA supports (``fla_seam.features``), asserted for each release it can be: fla-core 0.6
(CI's main and newest-torch stacks) and 0.5.2 (CI's FLA 0.5.2 stack, ``.ci/setup-stack fla052``).

Each test says what 0.6 does and what 0.5.2 does, and asserts the one installed; the differences were read in
both releases' sources (``fla/modules/causal_conv1d`` vs ``fla/modules/conv``, ``fla/ops/cp/context.py``,
``fla/ops/gated_delta_rule/chunk.py``).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from fla_ac_isolation.fla_seam import features
from fla_ac_isolation.fla_seam.features import FlaFeatureError, module, module_path, require, supports
from fla_ac_isolation.fla_seam.install import import_problem
from fla_ac_isolation.fla_seam.layout import conv_takes_chunk_indices
from fla_ac_isolation.fla_seam.versions import fla_version
from fla_ac_isolation.parallel import CPConfig, CPSeqlens

VERSION = fla_version()
NEW = tuple(int(p) for p in VERSION.split(".")[:2]) >= (0, 6)  # fla-core 0.6.x; else 0.5.2


def test_the_conv_and_norm_live_where_the_installed_release_defines_them():
    expected = ({"conv": "fla.modules.causal_conv1d.ops", "conv_ops": "fla.modules.causal_conv1d.ops",
                 "conv_cp": "fla.modules.causal_conv1d.cp", "l2norm": "fla.modules.norm.l2norm"} if NEW else
                {"conv": "fla.modules.conv.causal_conv1d", "conv_ops": "fla.modules.conv.triton.ops",
                 "conv_cp": "fla.modules.conv.cp.ops", "l2norm": "fla.modules.l2norm"})
    assert {role: module_path(role) for role in expected} == expected
    # the public conv is the object FLA's own conv package exports (what foreign code imports, serving replaces)
    package = importlib.import_module("fla.modules.causal_conv1d" if NEW else "fla.modules.conv")
    assert module("conv").causal_conv1d is package.causal_conv1d
    assert hasattr(module("conv_ops"), "causal_conv1d_fwd") and hasattr(module("conv_cp"), "causal_conv1d_cp")
    assert hasattr(module("l2norm"), "l2norm_fwd")
    with pytest.raises(ValueError, match=r"role must be one of \('conv', 'conv_ops', 'conv_cp', 'l2norm'\), got 'x'"):
        module_path("x")


def test_the_conv_chunk_parameter_is_named_per_release_and_the_schedule_is_handed_on_in_both():
    assert features.conv_chunk_parameter() == ("chunk_size" if NEW else "BT")
    assert conv_takes_chunk_indices()  # 64-token chunks in both releases, so our schedule fits FLA's conv


def test_what_needs_fla_06_is_supported_exactly_on_06():
    assert {f.key: supports(f.key) for f in features.FEATURES} == {"cp": NEW, "gdn_chunk_indices": NEW,
                                                                    "ssd_kernels": NEW}
    assert all(f.since == "0.6.0" for f in features.FEATURES)
    with pytest.raises(ValueError, match=r"feature must be one of \('cp', 'gdn_chunk_indices', 'ssd_kernels'\), got 'nope'"):
        supports("nope")


def _needs_06(where: str, feature: str, api: str) -> str:
    return (f"{where} needs fla-core >= 0.6.0 ({feature}: {api}); installed: fla-core {VERSION}. Install "
            "'fla-core>=0.6.0,<0.7' (pip install -U fla-ac-isolation brings it)")


CP = ("context parallelism (CPConfig, CPSeqlens, CP kernels on a CPU)",
      "fla.ops.cp.context.get_cp_cu_seqlens(layout=) and its layout-aware FLACPContext")


def test_zigzag_cp_needs_06_at_the_config_and_contiguous_config_validates_on_both():
    contiguous = CPConfig(world_size=2, rank=0)  # validation only: no FLA needed, on either release
    assert contiguous.num_parts == 2
    if NEW:
        assert CPConfig(world_size=2, rank=1, layout="zigzag").num_parts == 4
    else:
        with pytest.raises(FlaFeatureError) as info:
            CPConfig(world_size=2, rank=1, layout="zigzag")
        assert str(info.value) == _needs_06("CPConfig(layout='zigzag')", *CP)


def test_cp_seqlens_needs_06_where_flas_context_is_built():
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    if NEW:
        seqlens = CPSeqlens(cu, cu_seqlens_cpu=cu, num_tokens=16, cp=CPConfig(world_size=2, rank=1))
        assert seqlens.local().cp_context.cu_seqlens.tolist() == [0, 8]  # rank 1 holds tokens 8..15 of document 2
    else:
        with pytest.raises(FlaFeatureError) as info:
            CPSeqlens(cu, cu_seqlens_cpu=cu, num_tokens=16, cp=CPConfig(world_size=2, rank=1))
        assert str(info.value) == _needs_06("CPSeqlens(cp=CPConfig(layout='contiguous'))", *CP)


def test_the_cp_probe_reads_layout_in_flas_signature_not_the_modules_presence(monkeypatch):
    """fla-core 0.5.2 has ``fla.ops.cp.context.get_cp_cu_seqlens`` but no ``layout=``: a probe of the module's
    presence would pass it, and zigzag CP would then fail inside FLA. Here, on either release, a
    ``get_cp_cu_seqlens`` without ``layout=`` is put in FLA's module: the probe says no and the config refuses."""
    context = importlib.import_module("fla.ops.cp.context")

    def get_cp_cu_seqlens(cu_seqlens, cu_seqlens_cpu=None, group=None):  # no layout=
        raise AssertionError("the probe reads the signature; it never calls FLA")

    monkeypatch.setattr(context, "get_cp_cu_seqlens", get_cp_cu_seqlens)
    supports.cache_clear()
    try:
        assert supports("cp") is False
        with pytest.raises(FlaFeatureError) as info:
            CPConfig(world_size=2, rank=1, layout="zigzag")
        assert str(info.value) == _needs_06("CPConfig(layout='zigzag')", *CP)
    finally:
        supports.cache_clear()  # the next call reads FLA's own function again


def test_require_passes_silently_only_where_supported():
    if NEW:
        require("gdn_chunk_indices", where="x")
    else:
        with pytest.raises(FlaFeatureError) as info:
            require("gdn_chunk_indices", where="chunk_gated_delta_rule(chunk_indices=) in a CUDA graph")
        assert str(info.value) == _needs_06(
            "chunk_gated_delta_rule(chunk_indices=) in a CUDA graph",
            "the chunk schedule handed to FLA's gated delta rule (no host sync; CUDA graphs)",
            "fla.ops.gated_delta_rule.chunk_gated_delta_rule(chunk_indices=)")


def test_doctor_lists_each_feature_that_needs_06_and_whether_this_fla_has_it():
    from fla_ac_isolation.harness.environment import environment_report

    report = environment_report()
    lines = {k: v for k, v in report.items() if k.startswith("FLA feature: ")}
    assert lines == {
        f"FLA feature: {f.name}": "yes" if NEW else f"no (needs fla-core >= 0.6.0: {f.api}; installed {VERSION})"
        for f in features.FEATURES
    }
    # fla-core 0.6 memoises 17 index helpers with tensor_cache, 0.5.2 14 (read in both releases)
    assert report["FLA cached helpers"] == ("17" if NEW else "14")


@pytest.mark.parametrize(("fla", "triton", "broken"), [
    ("0.5.2", "3.9.0", True), ("0.5.2", "3.8.0", False), ("0.5.2", "3.6.0", False), ("0.6.0", "3.9.0", False),
])
def test_import_problem_is_known_from_metadata_for_fla_052_with_triton_39(monkeypatch, fla, triton, broken):
    versions = {"fla-core": fla, "triton": triton}
    monkeypatch.setattr(features, "fla_version", lambda: fla)
    monkeypatch.setattr(features.importlib.metadata, "version", lambda dist: versions[dist])
    expected = (f"fla-core {fla} does not import with triton {triton} (FLA's autotune keys name BT, which Triton "
                ">= 3.9 refuses); install 'triton>=3.6,<3.9' (pip install 'fla-ac-isolation[fla052]' pins both) or "
                "upgrade to 'fla-core>=0.6,<0.7'")
    assert import_problem() == (expected if broken else None)


_FAKE_FLA = '''
import importlib.metadata, sys
sys.path.insert(0, sys.argv[1])                       # a package named fla that fails as FLA 0.5.2 does
real = importlib.metadata.version
fake = {"fla-core": "0.5.2", "triton": "3.9.0"}
importlib.metadata.version = lambda d: fake[d] if d in fake else real(d)
if sys.argv[2] == "with-seam":
    import fla_ac_isolation
try:
    import fla
except Exception as e:
    print(type(e).__name__, "|", e, "|", type(e.__cause__).__name__)
'''


@pytest.mark.parametrize("seam", ["with-seam", "without"])
def test_the_seam_turns_flas_import_failure_into_one_naming_the_triton_bound(tmp_path, seam):
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text(
        "raise ValueError('key contains names that are not kernel arguments: BT')\n")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAKE_FLA), str(tmp_path), seam],
                         capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    if seam == "with-seam":
        assert out == ("ImportError | fla-core 0.5.2 does not import with triton 3.9.0 (FLA's autotune keys name BT, "
                       "which Triton >= 3.9 refuses); install 'triton>=3.6,<3.9' (pip install "
                       "'fla-ac-isolation[fla052]' pins both) or upgrade to 'fla-core>=0.6,<0.7' | ValueError")
    else:  # FLA's own message, which names neither triton nor a fix
        assert out == "ValueError | key contains names that are not kernel arguments: BT | NoneType"


def test_the_probes_read_flas_own_objects_even_while_reference_kernels_serve_its_functions():
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    supports.cache_clear()
    try:
        with reference_kernels():  # FLA's chunk_gated_delta_rule is our stand-in here, which names chunk_indices
            assert supports("gdn_chunk_indices") is NEW and supports("cp") is NEW
    finally:
        supports.cache_clear()


def test_the_entry_points_ops_calls_are_flas_package_objects_found_without_a_graph_break():
    """``ops`` reaches FLA's gated delta rule and KDA through these two functions: the objects FLA's packages bind
    (what foreign code imports and the CPU serving replaces), looked up by an import statement, which
    ``torch.compile`` traces; :func:`module`'s cached layout probe is a graph break (shown for contrast)."""
    import torch

    gdn = importlib.import_module("fla.ops.gated_delta_rule")
    assert features.gdn_entry_point() is gdn.chunk_gated_delta_rule
    if NEW:  # fla-core 0.5.2 has no KDA
        assert features.kda_entry_point() is importlib.import_module("fla.ops.kda").chunk_kda

    def by_entry_point(x):
        y = x * 2
        return y + 1, features.gdn_entry_point()

    def by_module(x):
        y = x * 2
        return y + 1, module("l2norm").l2norm_fwd

    breaks = {fn.__name__: len(torch._dynamo.explain(fn)(torch.ones(2)).break_reasons)
              for fn in (by_entry_point, by_module)}
    assert breaks == {"by_entry_point": 0, "by_module": 1}

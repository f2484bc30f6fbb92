"""An installed but broken ``causal_conv1d`` (an ``OSError`` at import, as a build for another CUDA gives) is the
conv leak, as a missing one is: transformers' kernel loader falls back to its torch conv on any exception
(``use_kernel_func_from_hub_with_fallback``), so the six transformers Gated DeltaNets mix packed documents there.
The package is planted in a temporary directory on ``sys.path``."""

from __future__ import annotations

import sys

import pytest

from fla_ac_isolation.families import FAMILIES
from fla_ac_isolation.foreign_classes import FLA_BACKED_MIXERS
from fla_ac_isolation.harness.environment import environment_report

BROKEN = 'raise OSError("libcudart.so.11.0: cannot open shared object file: No such file or directory")\n'
GDNS = ("Qwen3_5MoeGatedDeltaNet, Qwen3_5GatedDeltaNet, Qwen4ExpTextGatedDeltaNet, Qwen3NextGatedDeltaNet, "
        "OlmoHybridGatedDeltaNet, LaraMiniGatedDeltaNet")


def _plant(tmp_path, monkeypatch, body: str) -> None:
    package = tmp_path / "causal_conv1d"
    package.mkdir()
    (package / "__init__.py").write_text(body)
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


def _conv_leak():
    (leak,) = {e.leaks_without for e in FLA_BACKED_MIXERS if e.leaks_without is not None}
    return leak


def test_a_causal_conv1d_that_raises_oserror_at_import_is_reported_as_the_conv_leak(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, BROKEN)
    with pytest.raises(OSError, match="libcudart"):
        __import__("causal_conv1d")  # the planted package is what an import finds
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)

    leak = _conv_leak()
    qwen = next(u for u in FAMILIES["qwen3_5_moe"].upstream if u.name == "Qwen3_5MoeGatedDeltaNet")
    assert leak.package == "causal_conv1d" and leak.applies()
    assert qwen.leak() == ("its short conv runs transformers' torch causal_conv1d_fn across document boundaries (the "
                           "causal_conv1d package cannot be imported here)")
    assert environment_report()["causal_conv1d"] == (
        f"not importable: 6 classes with a conv that needs it mix packed documents ({GDNS}; listed below)")


def test_a_causal_conv1d_that_imports_is_not_a_leak(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, "")
    assert not _conv_leak().applies()
    assert environment_report()["causal_conv1d"] == "importable"

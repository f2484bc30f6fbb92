"""The 0.3 import paths of the modules that moved into ``harness/`` (or were merged into another module) still
import, as deprecated aliases.

Each old path imports (in a fresh interpreter, parents first), emits exactly one ``DeprecationWarning`` with the
text below, and is the very module object of its new path (``__name__`` and ``__spec__`` the new path's); ``python
-m`` with the old command path runs the command; the 0.3 top-level names resolve without a warning; a path that did
not move is not touched by the finder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import fla_ac_isolation
from fla_ac_isolation import _moved

# every 0.3 module path that moved, written out (not derived from _moved.MOVED): what 0.3 users may import
OLD_PATHS = (
    "audit_runner", "check_runner", "cli", "cli.audit", "cli.check", "cli.console", "cli.doctor", "cli.regress",
    "cli.regress_render", "environment", "extras", "failures", "fault_stack", "fla_seam.interpreter",
    "fla_seam.models", "fla_seam.served_ops", "fla_seam.serving", "foreign_models", "modes", "reference_kernels",
    "regression", "regression._preload", "regression.cp_report", "regression.data", "regression.expert_parallel",
    "regression.launch", "regression.model", "regression.pipeline", "regression.pp_report", "regression.report",
    "regression.run", "regression.spec", "regression.torchrun", "regression.train", "testing", "testing.gpu",
    "testing.olmo_core", "testing.sync_ops",
)  # and cli.__main__, which runs the command on import: checked through python -m below

# 0.3's fla_ac_isolation.__all__
TOP_LEVEL_0_3 = (
    "LayerLocalSeqlens", "LocalSeqlens", "StaticSeqlens", "checkpoint_layers", "probe_tensor_cache",
    "tensor_cache_disabled", "CPConfig", "ReplayAudit", "ReplayDivergenceError", "swap_mixers", "restore_mixers",
    "isolate_seqlens", "IsolationHandle", "LeakingMixerWarning",
)
# 0.3's top-level mixers left the top level in 0.4 (fla_ac_isolation.mixers): they resolve with a
# DeprecationWarning, which tests/test_public_names.py asserts
MIXERS_0_3 = ("Qwen3_5MoeGatedDeltaNet", "Qwen3_8FlashNextGatedDeltaNet", "NemotronHMamba2Mixer")

_IMPORT_SCRIPT = r"""
import importlib, json, sys, warnings
import fla_ac_isolation
out = {}
for relative in sys.argv[1].split(","):
    old = "fla_ac_isolation." + relative
    assert old not in sys.modules, old
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    new = "fla_ac_isolation.harness." + relative
    out[relative] = {
        "warnings": [(w.category.__name__, str(w.message)) for w in caught
                     if issubclass(w.category, DeprecationWarning) and "fla_ac_isolation" in str(w.message)],
        "same": module is sys.modules[new] and sys.modules[old] is sys.modules[new],
        "name": module.__name__, "spec": module.__spec__.name,
    }
print(json.dumps(out))
"""


def test_every_old_path_imports_warns_once_and_is_the_new_module():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT, ",".join(sorted(OLD_PATHS))],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out) == sorted(OLD_PATHS)
    for relative, seen in out.items():
        old, new = f"fla_ac_isolation.{relative}", f"fla_ac_isolation.harness.{relative}"
        expected = f"{old} is deprecated (its 0.3 path): the module moved to {new}; import {new} instead"
        assert seen == {"warnings": [["DeprecationWarning", expected]], "same": True, "name": new, "spec": new}


# 0.3 modules merged into another module in 0.4 (one definition per operation): old path -> the module it now is
MERGED = {
    "fla_ac_isolation.fla_seam.kernels": "fla_ac_isolation.ops",
    "fla_ac_isolation.fla_seam.custom_ops": "fla_ac_isolation.ops.saveable",
    "fla_ac_isolation.ops.reference_ops": "fla_ac_isolation.ops.saveable",
}

_MERGED_SCRIPT = r"""
import importlib, json, sys, warnings
import fla_ac_isolation
out = {}
for old, new in json.loads(sys.argv[1]).items():
    assert old not in sys.modules, old
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = {
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, DeprecationWarning) and "fla_ac_isolation" in str(w.message)],
        "same": module is sys.modules[new] and sys.modules[old] is sys.modules[new], "name": module.__name__,
        # what a 0.3 caller of each module reached for: the entry points (ops), the registered operators
        "entry_points": all(hasattr(module, n) for n in ("causal_conv1d", "chunk_gated_delta_rule", "ssd")),
        "operators": hasattr(module, "TABLE"),
    }
print(json.dumps(out))
"""


def test_a_merged_module_path_imports_warns_once_and_is_the_module_it_merged_into():
    proc = subprocess.run([sys.executable, "-c", _MERGED_SCRIPT, json.dumps(MERGED)], capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for old, new in MERGED.items():
        expected = f"{old} is deprecated (its 0.3 path): the module moved to {new}; import {new} instead"
        is_ops = new == "fla_ac_isolation.ops"
        assert out[old] == {"warnings": [expected], "same": True, "name": new, "entry_points": is_ops,
                            "operators": not is_ops}
    assert {_moved.new_path(old) for old in MERGED} == set(MERGED.values())


def test_the_warning_text_for_one_path_written_out():
    assert _moved.deprecation_message("fla_ac_isolation.modes", "fla_ac_isolation.harness.modes") == (
        "fla_ac_isolation.modes is deprecated (its 0.3 path): the module moved to fla_ac_isolation.harness.modes; "
        "import fla_ac_isolation.harness.modes instead"
    )


def test_the_table_maps_exactly_the_old_paths_and_their_submodules():
    assert {_moved.new_path(f"fla_ac_isolation.{p}") for p in OLD_PATHS} == {
        f"fla_ac_isolation.harness.{p}" for p in OLD_PATHS
    }
    for unmoved in ("fla_ac_isolation", "fla_ac_isolation.fla_seam", "fla_ac_isolation.fla_seam.kda",
                    "fla_ac_isolation.harness.modes", "fla_ac_isolation.modesx", "fla_ac_isolation.clix.a",
                    "fla_ac_isolation.policies", "modes", "other.modes"):
        assert _moved.new_path(unmoved) is None, unmoved


def test_an_old_package_path_keeps_its_public_names():
    with pytest.warns(DeprecationWarning, match=r"fla_ac_isolation\.modes is deprecated"):
        sys.modules.pop("fla_ac_isolation.modes", None)
        from fla_ac_isolation.modes import MODES, SharedSeqlens
    from fla_ac_isolation.harness import modes

    assert MODES is modes.MODES and SharedSeqlens is modes.SharedSeqlens


def test_python_m_with_the_old_command_path_runs_the_command():
    proc = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "fla_ac_isolation.cli",
                           "--version"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"fla-ac-isolation {fla_ac_isolation.__version__}"
    assert ("DeprecationWarning: fla_ac_isolation.cli is deprecated (its 0.3 path): the module moved to "
            "fla_ac_isolation.harness.cli; import fla_ac_isolation.harness.cli instead") in proc.stderr


@pytest.mark.parametrize("name", TOP_LEVEL_0_3)
def test_a_0_3_top_level_name_resolves_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        value = getattr(fla_ac_isolation, name)
    assert value is not None
    assert name in fla_ac_isolation.__all__



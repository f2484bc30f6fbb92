"""The public names: what ``fla_ac_isolation`` offers at the top level (lazily where heavy), what ``dir()`` lists,
and that ``fla_ac_isolation.ops`` exports its operations, not its internal validators."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fla_ac_isolation
from fla_ac_isolation import ops

# each top-level name and the module that defines it (read independently of fla_ac_isolation._LAZY)
TOP_LEVEL = {
    "CPConfig": "fla_ac_isolation.parallel.config",
    "ReplayDivergenceError": "fla_ac_isolation.audit.recorder",
    "IsolationHandle": "fla_ac_isolation.isolate",
    "ReplayAudit": "fla_ac_isolation.audit.replay_audit",
    "LayerLocalSeqlens": "fla_ac_isolation.seqlens",
    "LocalSeqlens": "fla_ac_isolation.local_seqlens",
    "PackedSeqlens": "fla_ac_isolation.local_seqlens",
    "StaticSeqlens": "fla_ac_isolation.graphs",
    "swap_mixers": "fla_ac_isolation.swap",
    "isolate_seqlens": "fla_ac_isolation.isolate",
}


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
def test_public_name_is_at_the_top_level_listed_by_dir_and_all(name):
    import importlib

    assert getattr(fla_ac_isolation, name) is getattr(importlib.import_module(TOP_LEVEL[name]), name)
    assert name in dir(fla_ac_isolation)
    assert name in fla_ac_isolation.__all__


def test_an_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'fla_ac_isolation' has no attribute 'CPConfg'"):
        fla_ac_isolation.CPConfg  # noqa: B018


_LAZY_SCRIPT = r"""
import json, sys
import fla_ac_isolation
heavy = ("fla_ac_isolation.audit", "fla_ac_isolation.parallel", "fla_ac_isolation.isolate", "fla_ac_isolation.swap",
         "fla_ac_isolation.mixers")
before = [m for m in heavy if m in sys.modules]
listed = dir(fla_ac_isolation)
after_dir = [m for m in heavy if m in sys.modules]
fla_ac_isolation.CPConfig
print(json.dumps({"before": before, "after_dir": after_dir, "listed": listed,
                  "after_access": [m for m in heavy if m in sys.modules]}))
"""


def test_lazy_names_are_listed_by_dir_without_being_imported():
    proc = subprocess.run([sys.executable, "-c", _LAZY_SCRIPT], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [] and out["after_dir"] == []
    assert {"CPConfig", "ReplayDivergenceError", "IsolationHandle", "ReplayAudit", "swap_mixers",
            "isolate_seqlens"} <= set(out["listed"])
    assert out["after_access"] == ["fla_ac_isolation.parallel"]


def test_ops_exports_its_operations_and_their_argument_values_only():
    assert ops.__all__ == [
        "BACKENDS", "SAVEABLE_OPS", "Backend", "causal_conv1d", "chunk_gated_delta_rule", "chunk_kda", "ssd",
    ]
    assert not hasattr(ops, "check_chunk_indices")  # private to ops now: only its operations use it


def test_the_backend_validators_live_in_ops_backend():
    from fla_ac_isolation.ops import backend

    assert backend.BACKENDS is ops.BACKENDS
    assert backend.check_backend("fla") == "fla"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'fla', 'reference'\), got 'cuda'"):
        backend.check_backend("cuda")
    with pytest.raises(TypeError, match="saveable must be True or False, got 1"):
        backend.check_saveable(1)


def test_saveable_operations_have_one_list_of_names():
    from fla_ac_isolation.fla_seam.saveable_kernels import KERNELS
    from fla_ac_isolation.op_names import SAVEABLE_OP_NAMES
    from fla_ac_isolation.ops import saveable

    assert SAVEABLE_OP_NAMES == ("gated_delta_rule", "causal_conv1d", "ssd")
    assert tuple(ops.SAVEABLE_OPS) == tuple(KERNELS) == SAVEABLE_OP_NAMES
    assert tuple(saveable.OVERLOADS) == ("fla", "reference")
    assert all(tuple(table) == SAVEABLE_OP_NAMES for table in (*saveable.TABLE.values(), *saveable.OVERLOADS.values()))


# 0.3's top-level mixer names, deprecated in 0.4, are gone in 0.5: the drop-ins live in fla_ac_isolation.mixers
@pytest.mark.parametrize("name", ["Qwen3_5MoeGatedDeltaNet", "Qwen3_8FlashNextGatedDeltaNet", "NemotronHMamba2Mixer"])
def test_a_0_3_top_level_mixer_name_is_gone(name):
    import fla_ac_isolation.mixers

    with pytest.raises(AttributeError, match=rf"^module 'fla_ac_isolation' has no attribute '{name}'$"):
        getattr(fla_ac_isolation, name)
    assert getattr(fla_ac_isolation.mixers, name).__name__ == name


def test_all_is_the_library_calls_and_no_mixer():
    assert sorted(fla_ac_isolation.__all__) == sorted([
        "LayerLocalSeqlens", "LocalSeqlens", "PackedSeqlens", "StaticSeqlens", "checkpoint_layers",
        "probe_tensor_cache", "tensor_cache_disabled", "CPConfig", "ReplayAudit", "ReplayDivergenceError", "swap_mixers",
        "restore_mixers", "isolate_seqlens", "IsolationHandle", "LeakingMixerWarning",
    ])

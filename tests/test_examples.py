"""Every example under examples/ runs on CPU and shows what its docstring promises (hf_swap: test_swap_example.py)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import SharedOutcome

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
INT_REPLAY = "Autograd not support dtype: Int"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: own_model's shared path under save-all-copies (torch 2.13, FLA 0.6.0): layer 0's recompute hits FLA's
#: cache and skips the int32 -> int64 casts its forward ran, so the MoE's load cast (the next saved
#: ``_to_copy``) is replayed with one of FLA's int32 tensors and ``load.mean()`` refuses it.
OWN_MODEL_SHARED = SharedOutcome(
    RuntimeError, "mean(): could not infer output dtype. Input dtype must be either a floating point or complex "
    "dtype. Got: Int",
)


def test_own_model_shared_fails_and_isolated_matches_bit_for_bit(capsys):
    result = _load("own_model").main([])

    shared = result["shared, SAC save-all-copies"]
    OWN_MODEL_SHARED.check(shared.get("error"))
    assert shared["max_grad_diff"] is None
    for name in ("isolated, SAC save-all-copies", "isolated, full AC"):
        assert result[name]["loss"] == result["no-ac"]["loss"]
        assert result[name]["max_grad_diff"] == 0.0
    assert "ops backend: reference" in capsys.readouterr().out


def test_own_model_int64_offsets_leave_save_all_copies_nothing_to_shift(capsys):
    result = _load("own_model").main(["--dtype", "int64", "--doc-lens", "65,9"])
    assert result["shared, SAC save-all-copies"]["max_grad_diff"] == 0.0
    assert result["isolated, SAC save-all-copies"]["max_grad_diff"] == 0.0
    assert "saves none of the ops" in capsys.readouterr().out


def test_torchtitan_qwen3_5_as_shipped_and_fixed_match_shared_diverges(capsys):
    pytest.importorskip("torchtitan.models.qwen3_5")
    module = _load("torchtitan_qwen3_5")
    result = module.main([])

    for policy in module.POLICY_NAMES:
        for variant in ("as-shipped", "fixed"):
            run = result[(policy, variant)]
            assert run["error"] is None and run["max_grad_diff"] == 0.0, (policy, variant, run["error"])
            assert run["divergent"] == []
        assert result[(policy, "shared")]["divergent"] == ["layers.0"]
    # torchtitan's own policy saves none of the shifted ops: the fault stays latent on CPU
    assert result[("torchtitan", "shared")]["max_grad_diff"] == 0.0
    assert INT_REPLAY in result[("torchtitan+sub", "shared")]["error"]
    out = capsys.readouterr().out
    assert "served by fla_ac_isolation.ops.reference" in out
    assert "prepare_chunk_offsets missed in forward and hit in recompute" in out


def test_torchtitan_example_restores_fla_kernel_entry_points():
    pytest.importorskip("torchtitan.models.qwen3_5")
    module = _load("torchtitan_qwen3_5")
    model_module = importlib.import_module("torchtitan.models.qwen3_5.model")
    conv_module = importlib.import_module("fla.modules.conv.causal_conv1d")
    before = (model_module._fla_chunk_gated_delta_rule, conv_module.causal_conv1d)
    with module.fla_kernels_on_reference():
        assert model_module._fla_chunk_gated_delta_rule is not before[0]
    assert (model_module._fla_chunk_gated_delta_rule, conv_module.causal_conv1d) == before


def test_audit_failure_names_region_op_helper_and_fix(capsys):
    result = _load("audit_failure").main([])

    crash = result["crash"]
    assert INT_REPLAY in crash["plain_error"]
    assert crash["audited_error"].startswith("ReplayDivergenceError: ReplayAudit: region layers.0:")
    assert "prepare_chunk_indices missed in forward and hit in recompute" in crash["audited_error"]
    assert "Fix: give each layer its own cu_seqlens" in crash["audited_error"]
    assert crash["divergent"][0][0] == "layers.0" and crash["divergent"][0][2] == "layers.0.mixer"
    assert result["crash_fixed"] == {"error": None, "ok": True, "regions": 4}

    silent = result["silent"]
    assert silent["loss"] == silent["ref_loss"] and silent["max_grad_diff"] > 1e-3, "same loss, wrong gradients"
    assert silent["audited_max_grad_diff"] == silent["max_grad_diff"], "recording does not change results"
    assert silent["divergent"][0][0] == "layers.0"
    assert "prepare_chunk_indices" in silent["divergent"][0][2]
    assert result["silent_fixed"] == {"max_grad_diff": 0.0, "ok": True}
    assert "DIVERGENT at op #0" in capsys.readouterr().out

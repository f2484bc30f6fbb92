"""GPU: a tiny transformers model on FLA's Triton kernels under SAC, as transformers ships it and swapped.

transformers' Qwen3.5-MoE GatedDeltaNet calls FLA's ``chunk_gated_delta_rule`` on CUDA with the batch's one
``cu_seq_lens_q`` object in every layer: under a SAC policy that saves ``_to_copy`` its recompute runs other
ops than its forward. After :func:`~fla_ac_isolation.swap_mixers` the same model (same weights, same packed
batch from transformers' ``DataCollatorWithFlattening``) matches its no-AC run. FLA's #640 Hopper guard is
lifted and autotuning uses the first config, as in ``test_mixers_gpu.py``. CUDA reductions (MoE scatter,
bf16 matmuls) need not be bit-reproducible, so runs are compared against the spread of two no-AC runs.

The unswapped control asserts exactly how the shared path ends (``UNSWAPPED``), per case:

* bf16, ``save_all_copies``: ``RuntimeError: Autograd not support dtype: Int`` (a later saved cast of the
  block is replayed with one of FLA's int tensors), measured on an H200
  (``benchmarks/results/h200_swap_tests.log``);
* fp32, every ``_to_copy`` and ``mm`` saved: no error, the loss equal to no AC, and gradients off by more
  than the largest reference gradient (floor: relative 1.0; measured on an H200, torch 2.11, FLA 0.6.0:
  a relative 75).

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_swap_gpu.py``.
"""

import pytest
import torch
from helpers import (
    MODEL_FAMILIES,
    SWAP_POLICIES,
    SharedOutcome,
    max_grad_diff,
    packed_batch,
    set_checkpointing,
    train_step,
)

from fla_ac_isolation import swap_mixers
from fla_ac_isolation.policies import any_of, save_all_copies, save_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _copies_and_mm():
    return any_of(save_all_copies(), save_ops([torch.ops.aten.mm.default]))


POLICIES = {"save-all-copies": SWAP_POLICIES["save-all-copies"], "copies+mm": _copies_and_mm}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: How transformers' unswapped Qwen3.5-MoE ends under SAC on FLA's kernels (module docstring).
UNSWAPPED = {
    ("bf16", "save-all-copies"): SharedOutcome(RuntimeError, "Autograd not support dtype: Int"),
    ("fp32", "copies+mm"): SharedOutcome(None, floor=1.0),  # relative: max |grad diff| / max |reference grad|
}


def _cuda_batch() -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed_batch().items()}


def _model(name: str, swapped: bool, dtype: str = "bf16"):
    model = MODEL_FAMILIES[name].model().to("cuda", DTYPES[dtype])
    if swapped:
        assert swap_mixers(model) == list(MODEL_FAMILIES[name].paths)
    return model


def _steps(model, policy: str = "save-all-copies"):
    """Two no-AC steps (their spread is the noise floor) and one under the SAC ``policy``."""
    first, second = train_step(model, _cuda_batch()), train_step(model, _cuda_batch())
    set_checkpointing(model, POLICIES[policy]())
    sac = train_step(model, _cuda_batch())
    assert first.error is None and second.error is None, (first.error, second.error)
    return first, second, sac


def _largest_grad(step) -> float:
    return max(g.abs().max().item() for g in step.grads.values())


@pytest.mark.parametrize(("name", "dtype", "policy"), [("qwen3_5_moe", "bf16", "save-all-copies"),
                                                       ("nemotron_h", "bf16", "save-all-copies"),
                                                       ("qwen3_5_moe", "fp32", "copies+mm")])
def test_swapped_model_on_fla_kernels_under_sac_matches_no_ac(name, dtype, policy):
    first, second, sac = _steps(_model(name, swapped=True, dtype=dtype), policy)
    noise = max_grad_diff(first, second)
    assert sac.error is None, sac.error
    deviation = max_grad_diff(sac, first)
    print(f"GPU_SWAP {name} {dtype} {policy} swapped: loss {first.loss.item():.6f} / sac {sac.loss.item():.6f}; "
          f"max |grad diff| sac {deviation:.3e}, no-AC twice {noise:.3e}")
    assert torch.equal(sac.loss, first.loss) or abs((sac.loss - first.loss).item()) <= 1e-2 * abs(first.loss.item())
    assert deviation <= max(2 * noise, 1e-6)


@pytest.mark.parametrize(("dtype", "policy"), list(UNSWAPPED), ids=[f"{d}-{p}" for d, p in UNSWAPPED])
def test_transformers_qwen_on_fla_kernels_under_sac_fails_as_measured(dtype, policy):
    """The control: the same model as transformers ships it (FLA kernels, shared cu_seq_lens_q)."""
    first, second, sac = _steps(_model("qwen3_5_moe", swapped=False, dtype=dtype), policy)
    noise = max_grad_diff(first, second)
    outcome = UNSWAPPED[(dtype, policy)]
    if sac.error is not None:
        print(f"GPU_SWAP qwen3_5_moe {dtype} {policy} unswapped: SAC raised {type(sac.error).__name__}: {sac.error}")
        outcome.check(sac.error)
        return
    relative = max_grad_diff(sac, first) / _largest_grad(first)
    print(f"GPU_SWAP qwen3_5_moe {dtype} {policy} unswapped: loss {first.loss.item():.6f} / sac "
          f"{sac.loss.item():.6f}; max |grad diff| / max |grad| {relative:.3e}, no-AC twice {noise:.3e}")
    outcome.check(None, relative)
    loss_noise = abs((first.loss - second.loss).item())
    assert abs((sac.loss - first.loss).item()) <= max(2 * loss_noise, 1e-6 * abs(first.loss.item())), "loss as no AC"
    assert max_grad_diff(sac, first) > 10 * noise, "far above the no-AC spread"

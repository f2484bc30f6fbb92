"""GPU: a tiny transformers model on FLA's Triton kernels under SAC, as transformers ships it and swapped.

transformers' Qwen3.5-MoE GatedDeltaNet calls FLA's ``chunk_gated_delta_rule`` on CUDA with the batch's one
``cu_seq_lens_q`` object in every layer: under a SAC policy that saves ``_to_copy`` (``save_all_copies``)
its recompute runs other ops than its forward. After :func:`~fla_ac_isolation.swap_mixers` the same model
(same weights, same packed batch from transformers' ``DataCollatorWithFlattening``) matches its no-AC run.
bf16, FLA's #640 Hopper guard lifted and first-config autotuning, as in ``test_mixers_gpu.py``. CUDA
reductions (MoE scatter, bf16 matmuls) need not be bit-reproducible, so runs are compared against the
spread of two no-AC runs.

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_swap_gpu.py``.
"""

import pytest
import torch
from helpers import MODEL_FAMILIES, SWAP_POLICIES, max_grad_diff, packed_batch, set_checkpointing, train_step

from fla_ac_isolation import swap_mixers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def hopper_guard_lifted():
    from fla_ac_isolation.testing.autotune import first_autotune_config
    from fla_ac_isolation.testing.gpu import lift_hopper_gdn_guard

    with lift_hopper_gdn_guard() as lifted, first_autotune_config():
        yield lifted


def _cuda_batch() -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed_batch().items()}


def _model(name: str, swapped: bool):
    model = MODEL_FAMILIES[name].model().to("cuda", torch.bfloat16)
    if swapped:
        assert swap_mixers(model) == list(MODEL_FAMILIES[name].paths)
    return model


def _steps(model):
    """Two no-AC steps (their spread is the noise floor) and one under SAC ``save_all_copies``."""
    first, second = train_step(model, _cuda_batch()), train_step(model, _cuda_batch())
    set_checkpointing(model, SWAP_POLICIES["save-all-copies"]())
    sac = train_step(model, _cuda_batch())
    assert first.error is None and second.error is None, (first.error, second.error)
    return first, second, sac


@pytest.mark.parametrize("name", ["qwen3_5_moe", "nemotron_h"])
def test_swapped_model_on_fla_kernels_under_sac_matches_no_ac(name):
    first, second, sac = _steps(_model(name, swapped=True))
    noise = max_grad_diff(first, second)
    assert sac.error is None, sac.error
    deviation = max_grad_diff(sac, first)
    print(f"GPU_SWAP {name} swapped: loss {first.loss.item():.6f} / sac {sac.loss.item():.6f}; "
          f"max |grad diff| sac {deviation:.3e}, no-AC twice {noise:.3e}")
    assert torch.equal(sac.loss, first.loss) or abs((sac.loss - first.loss).item()) <= 1e-2 * abs(first.loss.item())
    assert deviation <= max(2 * noise, 1e-6)


def test_transformers_qwen_on_fla_kernels_under_sac_raises_or_diverges():
    """The control: the same model as transformers ships it (FLA kernels, shared cu_seq_lens_q)."""
    first, second, sac = _steps(_model("qwen3_5_moe", swapped=False))
    noise = max_grad_diff(first, second)
    if sac.error is not None:
        print(f"GPU_SWAP qwen3_5_moe unswapped: SAC raised {type(sac.error).__name__}: {sac.error}")
        return
    deviation = max_grad_diff(sac, first)
    print(f"GPU_SWAP qwen3_5_moe unswapped: max |grad diff| sac {deviation:.3e}, no-AC twice {noise:.3e}")
    assert deviation > max(10 * noise, 1e-3), "shared cu_seq_lens_q went unnoticed on the GPU"

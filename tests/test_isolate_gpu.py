"""GPU: isolate_seqlens on FLA's Triton kernels, transformers' Qwen3.5-MoE and OLMo-core's hybrid Transformer.

* transformers 5.24's ``Qwen3_5MoeForCausalLM`` (the tiny model of the swap tests), fp32, one packed batch from
  ``DataCollatorWithFlattening``, SAC through ``gradient_checkpointing_enable`` saving every ``_to_copy`` and
  every ``mm``: measured on an H200 before this test (torch 2.11, FLA 0.6.0), as shipped the loss equals no AC
  and the gradients are off by a relative 75x. Asserted: the same silent divergence as shipped; after
  ``isolate_seqlens``, equal to no AC within the spread of two no-AC runs.
* OLMo-core 3.0's own ``Transformer`` (``qwen3_5_like``: GDN, GDN, attention), bf16 autocast, OLMo-core's
  ``selected_ops`` policy plus every ``_to_copy``. The attention blocks use OLMo-core's ``torch`` backend with
  the package's per-document mask (``testing.olmo_core``; flash-attn need not be installed). Not measured on
  a GPU before: as shipped the audit must name ``blocks.0`` and FLA's helpers, and the step must either fail
  with a known misreplay error or have gradients off by more than 1% (which one happened is printed);
  isolated, equal to no AC within the spread of two no-AC runs.
* the same OLMo-core model with AC and inductor (``torch.compile``, torch's determinism check on, "default"):
  OLMo-core's own ``apply_compile`` (the checkpoint-wrapped blocks) and each block's module compiled inside
  its checkpoint: isolated, no ``CheckpointError`` and equal to compiled no AC within 1e-3 relative (fp32).

bf16/fp32 as stated; FLA's #640 Hopper guard lifted and first-config autotuning, as in ``test_swap_gpu.py``.
OLMo-core needs its import-time dependencies on the device image (cached-path and the boto3 / Google Cloud
Storage clients); without ``olmo_core`` those tests are skipped.

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_isolate_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    INT_REPLAY,
    MODEL_FAMILIES,
    divergent,
    max_grad_diff,
    olmo_apply_ac,
    olmo_batch,
    olmo_hybrid,
    olmo_step,
    packed_batch,
    set_checkpointing,
    train_step,
)

from fla_ac_isolation import ReplayAudit, isolate_seqlens
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
from fla_ac_isolation.policies import any_of, save_all_copies, save_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# what SAC's misreplay of FLA's integer tensors has been seen to raise (torch 2.11 / 2.13, CPU and H200)
KNOWN_MISREPLAY = (INT_REPLAY, "not implemented for 'Int'", "not found in storage", "have different metadata",
                   "split_with_sizes")
OLMO_GPU_PATTERN = ("gdn", "gdn", "attn")


def _relative_grad_error(result, reference) -> float:
    return max(((result.grads[n] - g).norm() / g.norm()).item() for n, g in reference.grads.items() if g.norm() > 0)


def _assert_within_noise(result, first, second, what: str) -> None:
    noise = max_grad_diff(first, second)
    assert result.error is None, f"{what}: {result.error}"
    deviation = max_grad_diff(result, first)
    print(f"GPU_ISOLATE {what}: loss {result.loss.item():.6f} / no AC {first.loss.item():.6f}; max |grad diff| "
          f"{deviation:.3e}, no-AC twice {noise:.3e}")
    assert abs((result.loss - first.loss).item()) <= 1e-5 * abs(first.loss.item())
    assert deviation <= max(2 * noise, 1e-6)


# ------------------------------------------------------------------------------------------ transformers
def test_transformers_qwen_on_fla_kernels_diverges_silently_as_shipped_and_matches_no_ac_isolated():
    model = MODEL_FAMILIES["qwen3_5_moe"].model().to("cuda")  # fp32, as measured

    def batch():
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed_batch().items()}

    def step():
        clear_tensor_cache()
        with ReplayAudit(model, on_divergence="record") as audit:
            result = train_step(model, batch())
        return result, audit

    first, second = step()[0], step()[0]
    set_checkpointing(model, any_of(save_all_copies(), save_ops([torch.ops.aten.mm.default])))
    shipped, shipped_audit = step()
    handle = isolate_seqlens(model)
    isolated, audit = step()

    assert first.error is None and second.error is None, (first.error, second.error)
    assert shipped.error is None, shipped.error  # silent, as measured on an H200
    relative = _relative_grad_error(shipped, first)
    print(f"GPU_ISOLATE transformers as shipped: loss {shipped.loss.item():.6f} / no AC {first.loss.item():.6f}; "
          f"max relative gradient error {relative:.3g} (75 measured before); divergent {divergent(shipped_audit)}")
    assert abs((shipped.loss - first.loss).item()) <= 1e-5 * abs(first.loss.item())  # the loss does not tell
    assert relative > 1.0
    assert divergent(shipped_audit)[0][0] == "model.layers.0" and "prepare_chunk_indices" in divergent(shipped_audit)[0][1]

    assert handle.paths == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert audit.ok
    _assert_within_noise(isolated, first, second, "transformers isolated")


# -------------------------------------------------------------------------------------------- OLMo-core
@pytest.fixture(scope="module")
def olmo():
    pytest.importorskip("olmo_core")
    from fla_ac_isolation.harness.testing.olmo_core import packed_attention_on_torch_backend

    with packed_attention_on_torch_backend():
        yield olmo_hybrid(OLMO_GPU_PATTERN, device="cuda")


def _olmo_steps(model, bf16: bool, steps: int = 1):
    results = []
    for _ in range(steps):
        with ReplayAudit(model, on_divergence="record") as audit:
            results.append((olmo_step(model, olmo_batch(device="cuda"), bf16), audit))
    return results


def test_olmo_core_hybrid_on_fla_kernels_misreplays_as_shipped_and_matches_no_ac_isolated(olmo):
    (first, _), (second, _) = _olmo_steps(copy.deepcopy(olmo), bf16=True, steps=2)
    shipped_model = copy.deepcopy(olmo)
    olmo_apply_ac(shipped_model, "selected_ops+to_copy")
    [(shipped, shipped_audit)] = _olmo_steps(shipped_model, bf16=True)
    model = copy.deepcopy(olmo)
    olmo_apply_ac(model, "selected_ops+to_copy")
    handle = isolate_seqlens(model)
    [(isolated, audit)] = _olmo_steps(model, bf16=True)

    assert first.error is None and second.error is None, (first.error, second.error)
    regions = divergent(shipped_audit)
    assert regions and regions[0][0] == "blocks.0" and regions[0][1], regions
    if shipped.error is not None:
        print(f"GPU_ISOLATE OLMo-core as shipped: raised {type(shipped.error).__name__}: {shipped.error}")
        assert any(text in str(shipped.error) for text in KNOWN_MISREPLAY), shipped.error
    else:
        relative = _relative_grad_error(shipped, first)
        print(f"GPU_ISOLATE OLMo-core as shipped: max relative gradient error {relative:.3g}")
        assert relative > 1e-2
    assert handle.paths == [f"blocks.{i}._checkpoint_wrapped_module.attention" for i in range(2)]
    assert audit.ok
    _assert_within_noise(isolated, first, second, "OLMo-core isolated")


@pytest.mark.slow  # torch.compile on a fresh machine: 73 s and 39 s on one H200
@pytest.mark.parametrize("order", ["olmo-apply_compile", "block-modules-inside-checkpoints"])
def test_olmo_core_compiled_with_the_determinism_check_raises_nothing_isolated(olmo, order):
    import torch._dynamo
    from torch.utils.checkpoint import CheckpointError

    def compiled(ac: bool, isolate: bool):
        torch._dynamo.reset()
        model = copy.deepcopy(olmo)
        if ac:
            olmo_apply_ac(model, "full")  # determinism_check="default", as OLMo-core applies it
        if order == "olmo-apply_compile" or not ac:
            model.apply_compile()  # OLMo-core's own: block.compile(fullgraph=False) per block, lm_head
        else:
            for block in model.blocks.values():
                block._checkpoint_wrapped_module.compile(fullgraph=False)
        if isolate:
            isolate_seqlens(model)
        return model

    [(reference, _)] = _olmo_steps(compiled(ac=False, isolate=True), bf16=False)
    [(shipped, shipped_audit)] = _olmo_steps(compiled(ac=True, isolate=False), bf16=False)
    [(isolated, audit)] = _olmo_steps(compiled(ac=True, isolate=True), bf16=False)

    assert reference.error is None, reference.error
    print(f"GPU_ISOLATE OLMo-core compiled ({order}) as shipped: "
          f"{type(shipped.error).__name__ + ': ' + str(shipped.error)[:200] if shipped.error else 'no error'}; "
          f"divergent {divergent(shipped_audit)}")
    if shipped.error is not None:
        assert any(text in str(shipped.error) for text in KNOWN_MISREPLAY), shipped.error
    else:
        assert [r for r, _ in divergent(shipped_audit)][:1] == ["blocks.0"]
    assert not isinstance(isolated.error, CheckpointError), isolated.error
    assert isolated.error is None, isolated.error
    assert audit.ok
    relative = _relative_grad_error(isolated, reference)
    print(f"GPU_ISOLATE OLMo-core compiled ({order}) isolated: max relative gradient error vs compiled no AC "
          f"{relative:.3e}")
    assert relative <= 1e-3

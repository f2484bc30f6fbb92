"""GPU: the saveable FLA operators on FLA's real kernels at 8192 tokens (bf16), under SAC.

A 2-layer stack (Qwen3.5 GDN, Nemotron-H Mamba2; ``backend="fla"``, ``saveable=True``) against itself without
AC under ``save_fla_ops`` composed with torchtitan's policy (core only, and core + conv), and without AC
against the default path. Printed (``-s``) as ``GPU_SAVEABLE <case> bit_exact=<bool> worst_grad_rel=<err>``;
checked against the tolerance of the other GPU AC tests (loss 1e-6, gradients 1e-3 relative; none of the
kernels use atomics, so bit-exact is expected). The recompute's operator calls are counted exactly: a
saved operator never runs there.

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_saveable_gpu.py`` (FLA's #640 guard lifted for
this module, announced; first autotune config only).
"""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, Block, recorded_step, relative_error
from torch import nn

from fla_ac_isolation.policies import any_of, checkpoint_layers, save_fla_ops, torchtitan_selective
from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DOC_LENS = [1024, 3000, 17, 2500, 1651]  # 8192 tokens, one document shorter than a chunk
SAVED = {"save-core": ("gated_delta_rule", "ssd"), "save-core+conv": ("gated_delta_rule", "ssd", "causal_conv1d")}


def _step(policy=None, saveable=True):
    device = torch.device("cuda")
    layers = nn.ModuleList(Block(FAMILIES[f].build(layer_idx=i, seed=i, backend="fla", saveable=saveable))
                           for i, f in enumerate(("qwen3_5_moe", "nemotron_h"))).to(device, torch.bfloat16)
    if policy is not None:
        checkpoint_layers(layers, mode="selective", policy=policy)
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    return recorded_step(layers, x, LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device))


def _compare(case: str, got, want) -> None:
    exact = torch.equal(got.loss, want.loss) and all(torch.equal(got.grads[n], g) for n, g in want.grads.items())
    worst = max(relative_error(got.grads[n], g) for n, g in want.grads.items())
    print(f"GPU_SAVEABLE {case} bit_exact={exact} loss_rel={relative_error(got.loss, want.loss):.3e} worst_grad_rel={worst:.3e}")
    assert relative_error(got.loss, want.loss) <= 1e-6
    assert relative_error(got.dx, want.dx) <= 1e-3 and worst <= 1e-3


def test_saveable_path_matches_the_default_path():
    _compare("saveable-vs-default", _step(), _step(saveable=False))


@pytest.mark.parametrize("mode", list(SAVED))
def test_saved_operators_do_not_rerun_and_gradients_match_no_ac(mode):
    reference = _step()
    step = _step(any_of(save_fla_ops(SAVED[mode]), torchtitan_selective()))
    _compare(mode, step, reference)
    expected = {} if "conv" in mode else {"causal_conv1d": 2}
    assert step.backward.forward_calls == expected
    assert step.backward.backward_calls == {"causal_conv1d": 2, "gated_delta_rule": 1, "ssd": 1}

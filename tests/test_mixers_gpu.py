"""GPU: the ``fla`` backend (FLA's Triton kernels) against the ``reference`` backend, at scale.

Each mixer family runs T = 8192 packed tokens in 5 documents, forward and backward, in float32 and
bfloat16, once per backend with identical weights and inputs. The relative error
``||fla - reference|| / ||reference||`` of the output, the input gradient and every parameter gradient is
printed (run with ``-s``) as ``GPU_PARITY <family> <dtype> <tensor> <rel_err>`` and checked against a
loose bound; the reference computes its recurrences in float32 in both cases.

FLA >= 0.5.2 refuses the gated delta rule and simple GLA backward on Hopper with Triton < 3.7.1 (FLA
issue #640). The device image pairs an H200 with Triton 3.6, so this module lifts that guard for its own
run only, via :func:`fla_ac_isolation.harness.testing.gpu.lift_hopper_gdn_guard`, which prints that it did.

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_mixers_gpu.py``.
"""

import pytest
import torch
from helpers import CORE_FAMILIES, FAMILIES, HIDDEN, Block, loss_and_grads, relative_error
from torch import nn

from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DOC_LENS = [1024, 3000, 17, 2500, 1651]  # 8192 tokens, one document shorter than a chunk
REL_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
#: The gradients FLA's #640 miscompile reaches (through the decay gate g), measured on H200 + Triton 3.6 in
#: fp32 with the guard lifted (benchmarks/results/h200_mixer_tests_*.log): A_log, dt_bias and the ``a``
#: projection of the GDN (Nemotron-H's SSD: A_log and dt_bias). Only these may be off; every other tensor is
#: compared in every dtype.
FLA_640_GATE_GRADS = frozenset({"grad:A_log", "grad:dt_bias", "grad:in_proj_a.weight"})


def _run(mixer: nn.Module, x: torch.Tensor, seqlens: LayerLocalSeqlens):
    x = x.detach().clone().requires_grad_()
    out = mixer(x, seqlens)
    weight = torch.randn(out.shape, generator=torch.Generator(device=x.device).manual_seed(7), device=x.device)
    (out.float() * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mixer.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CORE_FAMILIES)
def test_fla_backend_matches_reference_at_8k_tokens(name, dtype, hopper_guard_lifted):
    family = FAMILIES[name]
    device = torch.device("cuda")
    seqlens = LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device)
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(device, dtype)

    results = {}
    for backend in ("fla", "reference"):
        mixer = family.build(seed=1, backend=backend).to(device, dtype)
        results[backend] = _run(mixer, x, seqlens)
    (out_f, dx_f, grads_f), (out_r, dx_r, grads_r) = results["fla"], results["reference"]

    errors = {"output": relative_error(out_f, out_r), "grad:hidden_states": relative_error(dx_f, dx_r)}
    errors.update({f"grad:{n}": relative_error(g, grads_r[n]) for n, g in grads_f.items()})
    for tensor, err in errors.items():
        print(f"GPU_PARITY {name} {str(dtype).removeprefix('torch.')} {tensor} {err:.3e}", flush=True)
    bad = {t: e for t, e in errors.items() if e > REL_TOL[dtype]}
    excused = hopper_guard_lifted and dtype == torch.float32
    others = {t: e for t, e in bad.items() if not (excused and t in FLA_640_GATE_GRADS)}
    assert not others, others  # output, input gradient and every other parameter gradient, in every case
    if bad:
        # Measured on H200 + Triton 3.6 with the guard lifted: fp32 gradients through the gate `g`
        # (dt_bias, A_log, in_proj_a) are up to ~100% off while bf16 and every other tensor agree. That is
        # the miscompile FLA's guard (#640) exists for, not our code: recorded, not hidden.
        pytest.xfail(f"FLA #640 (Triton < 3.7.1 on Hopper, guard lifted): fp32 gate gradients off: {bad}")


@pytest.mark.parametrize("name", CORE_FAMILIES)
def test_fla_backend_under_selective_ac_matches_no_ac(name):
    """Three layers sharing one LayerLocalSeqlens, FLA kernels, SAC saving every _to_copy."""
    from fla_ac_isolation.policies import checkpoint_layers, save_all_copies

    family = FAMILIES[name]
    device = torch.device("cuda")
    seqlens = LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device)
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)

    def run(checkpointed: bool):
        layers = nn.ModuleList(Block(family.build(i, seed=i, backend="fla")) for i in range(3))
        layers = layers.to(device, torch.bfloat16)
        if checkpointed:
            checkpoint_layers(layers, mode="selective", policy=save_all_copies())
        return loss_and_grads(layers, x, seqlens)

    loss_ref, dx_ref, grads_ref = run(False)
    loss_ac, dx_ac, grads_ac = run(True)
    exact = torch.equal(loss_ac, loss_ref) and all(torch.equal(grads_ac[n], g) for n, g in grads_ref.items())
    worst = max(relative_error(grads_ac[n], g) for n, g in grads_ref.items())
    print(f"GPU_AC {name} bit_exact={exact} loss_rel={relative_error(loss_ac, loss_ref):.3e} worst_grad_rel={worst:.3e}")
    assert relative_error(loss_ac, loss_ref) <= 1e-6
    assert relative_error(dx_ac, dx_ref) <= 1e-3 and worst <= 1e-3


def _sync_sites(step) -> list[str]:
    """``file:line`` of every host synchronisation during ``step()`` (:func:`host_sync_sites`)."""
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    torch.cuda.synchronize()
    with host_sync_sites() as sites:
        step()
    return sites


@pytest.mark.parametrize("name", ["qwen3_5_moe", "nemotron_h"])
def test_layer_step_under_sac_syncs_only_where_fla_must(name):
    """Forward + recompute + backward of one checkpointed layer (torchtitan's SAC policy), bf16.

    Isolated with the precomputed schedule (``chunk_indices`` and ``chunk_offsets``): neither layer ever
    synchronises the host; the Mamba2 layer's SSD runs FLA's simple GLA kernels with the state count read on
    the host (``fla_seam.simple_gla``; FLA's own ``chunk_simple_gla`` synchronised 4 times per step in
    ``chunk_h.py``, and twice more building its schedule). Controls, same layer: without the schedule FLA's
    blocking host-to-device copy of the chunk indices syncs in forward and recompute (``index.py``); the
    shared object syncs on FLA's index helpers too. Each variant is measured after one warm-up step (the
    first step's compilation syncs).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from fla_ac_isolation.harness.modes import SharedSeqlens
    from fla_ac_isolation.policies import sac_context_fn, torchtitan_selective

    device = torch.device("cuda")
    layer = FAMILIES[name].build(0, seed=0, backend="fla").to(device, torch.bfloat16)
    layer = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                               context_fn=sac_context_fn(torchtitan_selective()))
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)

    def sites(make_seqlens) -> list[str]:
        def step():  # new offsets every step, as a data loader builds them (built outside the count)
            seqlens = make_seqlens()
            return lambda: layer(x, seqlens).float().square().mean().backward()

        step()()  # warm-up
        return _sync_sites(step())

    isolated = sites(lambda: LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device))
    no_schedule = sites(lambda: LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device, chunk_indices=False))
    shared = sites(lambda: SharedSeqlens.from_seq_lens(DOC_LENS, device=device))
    print(f"GPU_SYNCS {name} isolated={isolated} no_schedule={no_schedule} shared={shared}")
    assert isolated == [], isolated
    assert len([s for s in no_schedule if "fla/ops/utils/index.py" in s]) == 2, no_schedule
    assert not any("chunk_h.py" in s for s in no_schedule + shared), (no_schedule, shared)
    assert any("fla/ops/utils/index.py" in s for s in shared), shared

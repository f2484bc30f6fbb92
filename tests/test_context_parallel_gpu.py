"""GPU (one device): the CP metadata path on CUDA, and FLA's CP kernels over a one-rank group.

Not run on the CPU machines (no CUDA). What it checks:

* ``CPSeqlens(cu_cuda, cu_seqlens_cpu=host, cp=...)`` synchronises the host only where validation
  compares the device offsets with the host copy (``offsets.checked_host_copy``); building FLA's CP context adds none,
  and ``.local()`` none. The context's ``cu_seqlens`` lives on the GPU, its ``cu_seqlens_cpu`` on the host.
* The field's in-layer build (``harness.fla_seam.cp_field.build_cp_context_in_layer``, FLA's cached ``build_cp_context``
  from the device offsets) copies them to the host in the first call only (``fla/ops/cp/context.py``): the
  device-to-host copy that torchtitan's policy saves and that misaligns the recompute on an H200.
* A GDN mixer over a one-rank CP group (FLA's CP conv and gated delta rule, ``W = 1``) equals the same
  mixer without CP within 1e-4 relative (printed as ``GPU_CP1 <tensor> <rel_err>``).
* The field's fault on one GPU, as the CP issue measured it: 4 checkpointed blocks (a GDN mixer over the
  one-rank CP group, then an EP-style dispatch that copies its split sizes to the host and splits) under
  the field's SAC rule (``save_device_to_host_copies``). Each block building FLA's CP context from the one
  shared ``cu_seqlens`` fails in block 0's recompute with ``split_with_sizes`` handed FLA's offsets;
  ``CPSeqlens`` equals no AC bit for bit (printed as ``GPU_CP_FIELD``).

Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_context_parallel_gpu.py``. FLA's #640 guard
is lifted for this module's run (printed), as in ``test_mixers_gpu.py``.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from helpers import FAMILIES, HIDDEN
from torch import nn
from torch.utils.checkpoint import checkpoint

from fla_ac_isolation import LayerLocalSeqlens
from fla_ac_isolation.harness.modes import FieldCPSeqlens
from fla_ac_isolation.parallel import CPConfig, CPSeqlens
from fla_ac_isolation.policies import sac_context_fn, save_device_to_host_copies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENS = [10, 0, 20, 70, 28, 4096 - 128]


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank NCCL group (the CP group of the kernel case); destroyed after the module."""
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config
    from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", 0))
    with lift_hopper_gdn_guard(), first_autotune_config():
        yield dist.group.WORLD
    dist.destroy_process_group()


def _offsets():
    return torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


def test_cp_metadata_syncs_only_in_validation_and_never_per_layer():
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    host = _offsets()
    cu = host.cuda()
    torch.cuda.synchronize()
    with host_sync_sites() as built:
        seqlens = CPSeqlens(cu, cu_seqlens_cpu=host, cp=CPConfig(layout="zigzag", world_size=2, rank=1,
                                                                  conv_kernel_size=4))
    with host_sync_sites() as per_layer:
        local = seqlens.local()
        seqlens.local()
    print("GPU_CP_SYNCS construction", built, "local", per_layer)
    assert built and all("fla_ac_isolation/offsets.py" in site for site in built), built  # the comparison only
    assert per_layer == []
    assert local.cp_context.cu_seqlens.device.type == "cuda" and local.cp_context.cu_seqlens_cpu.device.type == "cpu"
    assert local.cp_context.cu_seqlens is local.cu_seqlens


def test_the_fields_in_layer_build_copies_the_offsets_to_the_host_once(one_rank_group):
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache
    from fla_ac_isolation.harness.fla_seam.cp_field import build_cp_context_in_layer
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    cu = _offsets().cuda()
    clear_tensor_cache()
    torch.cuda.synchronize()
    with host_sync_sites() as first:
        build_cp_context_in_layer(cu, group=one_rank_group, conv_kernel_size=4)
    with host_sync_sites() as second:
        build_cp_context_in_layer(cu, group=one_rank_group, conv_kernel_size=4)
    print("GPU_FIELD_SYNCS first", first, "second", second)
    assert any("fla/ops/cp/context.py" in site for site in first), first
    assert second == [], "FLA's cache hits: the recompute of layer 0 runs no copy"


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_8"])
def test_gdn_mixer_over_a_one_rank_cp_group_equals_no_cp(name, one_rank_group):
    device = torch.device("cuda")
    family = FAMILIES[name]
    mixer = family.build(seed=3, backend="fla").to(device)
    x = 0.5 * torch.randn(1, sum(LENS), HIDDEN, device=device, generator=torch.Generator(device).manual_seed(4))
    results = []
    for cp in (None, CPConfig(group=one_rank_group, conv_kernel_size=4)):
        mixer.zero_grad()
        if cp is None:
            seqlens = LayerLocalSeqlens(_offsets().to(device), cu_seqlens_cpu=_offsets())
        else:
            seqlens = CPSeqlens(_offsets().to(device), cu_seqlens_cpu=_offsets(), cp=cp)
        leaf = x.clone().requires_grad_()
        out = mixer(leaf, seqlens)
        (out * torch.cos(torch.arange(out.numel(), device=device)).reshape(out.shape)).sum().backward()
        results.append({"output": out.detach(), "dx": leaf.grad, **{n: p.grad.clone() for n, p in mixer.named_parameters()}})
    for key, want in results[0].items():
        rel = ((results[1][key] - want).norm() / want.norm().clamp_min(1e-30)).item()
        print("GPU_CP1", name, key, f"{rel:.2e}")
        assert rel <= 1e-4, (key, rel)


class _DispatchBlock(nn.Module):
    """A GDN mixer, then what an EP dispatcher does: split sizes copied to the host, the tokens split by them."""

    def __init__(self, mixer: nn.Module, split_sizes: list[int]) -> None:
        super().__init__()
        self.mixer = mixer
        self.register_buffer("split_sizes", torch.tensor(split_sizes))  # on the device, as routing counts are
        # one weight per "expert": its product saves the tokens for backward, so the recompute (torch's early
        # stop ends it after the last tensor backward needs) runs through the dispatch, as it does for MoE
        self.expert_scale = nn.Parameter(torch.linspace(1.0, 1.75, len(split_sizes)))

    def forward(self, h: torch.Tensor, seqlens) -> torch.Tensor:
        h = h + self.mixer(h, seqlens)
        sizes = self.split_sizes.to("cpu").tolist()  # the device-to-host copy the field's policy saves
        parts = torch.split(h, sizes, dim=1)
        return torch.cat([p * self.expert_scale[i] for i, p in enumerate(parts)], dim=1)


def _field_step(blocks, seqlens_of, x, checkpointed):
    leaf = x.clone().requires_grad_()
    h = leaf
    for block in blocks:
        seqlens = seqlens_of()
        if checkpointed:
            h = checkpoint(block, h, seqlens, use_reentrant=False,
                           context_fn=sac_context_fn(save_device_to_host_copies()))
        else:
            h = block(h, seqlens)
    loss = (h.float() * torch.cos(torch.arange(h.numel(), device=h.device)).reshape(h.shape)).sum()
    for block in blocks:
        block.zero_grad()
    loss.backward()
    return loss.detach(), [leaf.grad, *(p.grad.clone() for b in blocks for p in b.parameters())]


def test_field_in_layer_cp_build_fails_under_the_d2h_rule_and_isolation_equals_no_ac(one_rank_group):
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache

    device = torch.device("cuda")
    family = FAMILIES["qwen3_5_moe"]
    blocks = [_DispatchBlock(family.build(layer_idx=0, seed=10 + i, backend="fla"), [1024] * 4) for i in range(4)]
    blocks = [b.to(device, torch.bfloat16) for b in blocks]
    x = 0.5 * torch.randn(1, sum(LENS), HIDDEN, device=device, generator=torch.Generator(device).manual_seed(5))
    x = x.to(torch.bfloat16)
    cp = CPConfig(group=one_rank_group, conv_kernel_size=4)
    cu, host = _offsets().to(device), _offsets()

    one = CPSeqlens(cu, cu_seqlens_cpu=host, cp=cp)
    loss_ref, grads_ref = _field_step(blocks, lambda: one, x, checkpointed=False)
    isolated = CPSeqlens(cu, cu_seqlens_cpu=host, cp=cp)
    loss_iso, grads_iso = _field_step(blocks, lambda: isolated, x, checkpointed=True)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads_iso, grads_ref))
    print(f"GPU_CP_FIELD isolated: loss {loss_iso.item():.6f} / no AC {loss_ref.item():.6f}; max |grad diff| {diff:.3e}")
    assert torch.equal(loss_iso, loss_ref) and diff == 0.0

    clear_tensor_cache()  # block 0's forward misses FLA's cache and copies the offsets to the host; its recompute hits
    field = FieldCPSeqlens(cu, cu_seqlens_cpu=host, cp=cp)  # its layers still build from cu alone
    with pytest.raises(RuntimeError) as failure:
        _field_step(blocks, lambda: field, x, checkpointed=True)
    print("GPU_CP_FIELD field:", str(failure.value).splitlines()[0])
    offsets = ", ".join(str(v) for v in host.tolist())  # FLA's host copy of cu_seqlens, replayed into the split
    assert f"split_with_sizes expects split_sizes to sum exactly to {sum(LENS)}" in str(failure.value)
    assert f"split_sizes=[{offsets}]" in str(failure.value)

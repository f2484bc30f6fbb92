"""GPU: Mamba2's SSD core on FLA's simple GLA kernels without host syncs equals FLA's ``chunk_simple_gla``.

``fla_seam.simple_gla`` launches FLA's own kernels with the state count read on the host; FLA's entry point
reads it from the device (``chunk_h.py``, ``split_offsets[-1].item()``) in every forward, state rebuild and
backward, and builds its chunk schedule with a blocking copy. Both run here on the same inputs (bf16, 5
packed documents): outputs and gradients bit for bit, and the host syncs of each counted with
``host_sync_sites`` (the control: FLA's own path, which must sync where the module docstring says).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DOC_LENS = [1024, 3000, 17, 2500, 1651]


def test_simple_gla_without_host_syncs_equals_flas_chunk_simple_gla():
    from fla.ops.simple_gla import chunk_simple_gla

    from fla_ac_isolation import LayerLocalSeqlens
    from fla_ac_isolation.fla_seam.simple_gla import simple_gla
    from fla_ac_isolation.harness.testing.gpu import host_sync_sites

    device, tokens, heads = torch.device("cuda"), sum(DOC_LENS), 64  # Mamba2's SSD at hidden 2048: K = N, V = P
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(1, tokens, heads, 128, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, tokens, heads, 64, device=device, generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(1, tokens, heads, device=device, generator=gen)
    do = torch.randn(1, tokens, heads, 64, device=device, generator=gen, dtype=torch.bfloat16)

    def run(fn):
        """Warm-up, then one forward + backward with syncs counted; the offsets are built before the count,
        as a data loader builds them (building them copies host offsets to the device)."""
        fn([t.clone().requires_grad_() for t in (q, k, v, g)], LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device))
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        seqlens = LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device)
        torch.cuda.synchronize()
        with host_sync_sites() as sites:
            out = fn(leaves, seqlens)
            out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)], sites

    def ours(t, seqlens):
        local = seqlens.local()
        return simple_gla(*t, 1.0, local.cu_seqlens, local.chunk_indices, local.chunk_offsets)

    def flas(t, seqlens):
        local = seqlens.local()
        return chunk_simple_gla(*t, scale=1.0, cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu)[0]

    got, our_sites = run(ours)
    want, fla_sites = run(flas)
    print(f"GPU_SIMPLE_GLA ours={our_sites} fla={fla_sites}")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert our_sites == []
    assert sorted(s.rsplit(":", 1)[0].split("fla/")[-1] for s in fla_sites) == [
        "ops/common/chunk_h.py", "ops/common/chunk_h.py", "ops/common/chunk_h.py", "ops/utils/index.py",
    ], fla_sites

"""GPU: the KDA drop-ins on FLA's kernels (``chunk_kda`` and the causal conv, with offsets) against the reference.

For each transformers KDA class's replacement (Kimi-Linear, GLM-5-next, Bailing hybrid; tiny configs of
``helpers.FAMILIES``), in float32 and bfloat16:

* parity: one packed batch (1 025 tokens in 6 documents: several chunks, an empty and a one-token document),
  forward and backward, once per backend with identical weights and input; the relative error
  ``||fla - reference|| / ||reference||`` of the output, the input gradient and every parameter gradient is
  printed (``-s``) as ``GPU_KDA_PARITY <mixer> <dtype> <tensor> <rel_err>`` and bounded as in
  ``tests/test_mixers_gpu.py`` (float32 5e-3: FLA's float32 dots may run as TF32; bfloat16 3e-2: the kernel
  rounds its inputs and output to bfloat16 while the reference recurs in float32);
* packed against per document, FLA backend only: each document run alone (its own one-document offsets, so the
  same varlen kernels, no new compilation) gives the rows of the packed output and input gradient, and the
  parameter gradients add up to the packed ones. Printed as ``GPU_KDA_PACKED``; bound float32 5e-3, as for the
  parity above: FLA's float32 dots run as TF32 (unit roundoff 2^-11 = 4.9e-4), and a document's chunk
  boundaries differ packed and alone, so its products round differently (measured on one H200: up to 6.4e-4,
  the Bailing k_proj gradient; 1e-4 failed all three fp32 cases); bfloat16 3e-2 (matmuls of other shapes
  round differently in bfloat16).

FLA's #640 guard (Hopper, Triton < 3.7.1) refuses the gated ``chunk_bwd_dqkwg`` kernel, which KDA's backward
(``fla/ops/kda/chunk_bwd.py``) does not call; the ``hopper_guard_lifted`` fixture (conftest) is used for its
first-autotune-config half, which keeps a fresh H200 under a minute of compiling, and the float32 case is
asserted in full. Run on a CUDA machine: ``python -m pytest -m gpu -s tests/test_kda_gpu.py``.
"""

import pytest
import torch
from helpers import FAMILIES, HIDDEN, relative_error

from fla_ac_isolation.seqlens import LayerLocalSeqlens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("hopper_guard_lifted"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NAMES = ["kimi_linear", "glm5_next", "bailing_hybrid"]
DOC_LENS = [300, 0, 17, 640, 1, 67]  # 1025 tokens
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REL_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
PACKED_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


def _run(mixer, x: torch.Tensor, seqlens: LayerLocalSeqlens, weight: torch.Tensor):
    """Output, input gradient and parameter gradients of ``sum(mixer(x) * weight)``."""
    mixer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = mixer(x, seqlens)
    (out.float() * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()}


def _case(dtype: torch.dtype):
    device = torch.device("cuda")
    x = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    weight = torch.randn(1, sum(DOC_LENS), HIDDEN, generator=torch.Generator().manual_seed(7)).to(device)
    return x, weight, LayerLocalSeqlens.from_seq_lens(DOC_LENS, device=device)


@pytest.mark.slow  # the reference is a per-token loop: 28 s (Kimi, fp32) on one H200
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_fla_backend_matches_the_reference_on_a_packed_batch(name, dtype):
    x, weight, seqlens = _case(dtype)
    results = {}
    for backend in ("fla", "reference"):
        mixer = FAMILIES[name].build(seed=1, backend=backend).to("cuda", dtype)
        results[backend] = _run(mixer, x, seqlens, weight)
    (out_f, dx_f, grads_f), (out_r, dx_r, grads_r) = results["fla"], results["reference"]

    errors = {"output": relative_error(out_f, out_r), "grad:hidden_states": relative_error(dx_f, dx_r)}
    errors.update({f"grad:{n}": relative_error(g, grads_r[n]) for n, g in grads_f.items()})
    for tensor, err in errors.items():
        print(f"GPU_KDA_PARITY {name} {str(dtype).removeprefix('torch.')} {tensor} {err:.3e}", flush=True)
    assert all(torch.isfinite(t).all() for t in (out_f, dx_f, *grads_f.values()))
    bad = {t: e for t, e in errors.items() if not e <= REL_TOL[dtype]}
    assert not bad, bad


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_fla_backend_packed_equals_each_document_alone(name, dtype):
    x, weight, seqlens = _case(dtype)
    mixer = FAMILIES[name].build(seed=2, backend="fla").to("cuda", dtype)
    out, dx, grads = _run(mixer, x, seqlens, weight)

    pieces_out, pieces_dx, start = [], [], 0
    summed = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in grads.items()}
    for n in DOC_LENS:
        if n:
            alone = LayerLocalSeqlens.from_seq_lens([n], device="cuda")
            o, d, g = _run(mixer, x[:, start:start + n], alone, weight[:, start:start + n])
            pieces_out.append(o)
            pieces_dx.append(d)
            for k, v in g.items():
                summed[k] += v.float()
        start += n
    errors = {"output": relative_error(out, torch.cat(pieces_out, dim=1)),
              "grad:hidden_states": relative_error(dx, torch.cat(pieces_dx, dim=1))}
    errors.update({f"grad:{k}": relative_error(v, summed[k]) for k, v in grads.items()})
    for tensor, err in errors.items():
        print(f"GPU_KDA_PACKED {name} {str(dtype).removeprefix('torch.')} {tensor} {err:.3e}", flush=True)
    bad = {t: e for t, e in errors.items() if not e <= PACKED_TOL[dtype]}
    assert not bad, bad

"""FLA's real Triton kernels on CPU (``TRITON_INTERPRET=1``) against the reference backend.

Run by ``tests/test_ops_interpret.py`` in a fresh process, because ``TRITON_INTERPRET`` must be set
before FLA's kernels are decorated. Prints one JSON object: per case, the largest error of the output and
of every gradient, each divided by ``max(1, max |reference|)`` (sums over many tokens, e.g. the gradient
of ``A``, are large), and the seconds taken.

    TRITON_INTERPRET=1 python tests/interpret_cases.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from interpret_compare import compare, scaled_error  # noqa: E402

from fla_ac_isolation import ops  # noqa: E402
from fla_ac_isolation.fla_seam.layout import chunk_indices_for  # noqa: E402
from fla_ac_isolation.harness.fla_seam.interpreter import interpreter_shims  # noqa: E402
from fla_ac_isolation.ops import reference  # noqa: E402
from fla_ac_isolation.seqlens import LayerLocalSeqlens  # noqa: E402

LENS = [5, 0, 17, 1, 41]
LONG_LENS = [70, 0, 130, 3]  # documents spanning several 64-token chunks (for chunk_indices cases)


def case_causal_conv1d(local, chunk_indices=None) -> dict:
    """FLA's conv (given ``chunk_indices`` or computing its own) against the reference, which asks FLA's
    ``prepare_chunk_indices`` for the schedule."""
    T = int(local.cu_seqlens_cpu[-1])
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(1, T, 24, generator=g), "weight": torch.randn(24, 4, generator=g) * 0.5,
              "bias": torch.randn(24, generator=g) * 0.1}
    varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu}
    return compare(lambda **a: ops.causal_conv1d(**a, **varlen, chunk_indices=chunk_indices, backend="fla"),
                   lambda **a: reference.causal_conv1d(**a, **varlen), inputs)


def case_gated_delta_rule_gva(local, chunk_indices=None) -> dict:
    T = int(local.cu_seqlens_cpu[-1])
    g = torch.Generator().manual_seed(1)
    inputs = {
        "q": torch.randn(1, T, 2, 16, generator=g), "k": torch.randn(1, T, 2, 16, generator=g),
        "v": torch.randn(1, T, 4, 8, generator=g), "g": -torch.rand(1, T, 4, generator=g),
        "beta": torch.rand(1, T, 4, generator=g),
    }
    varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu}
    return compare(lambda **a: ops.chunk_gated_delta_rule(**a, **varlen, chunk_indices=chunk_indices,
                                                              backend="fla"),
                   lambda **a: reference.chunk_gated_delta_rule(**a, **varlen), inputs)


def case_ssd_on_simple_gla(local) -> dict:
    T = int(local.cu_seqlens_cpu[-1])
    g = torch.Generator().manual_seed(2)
    inputs = {
        "x": torch.randn(1, T, 4, 16, generator=g) * 0.5, "dt": torch.randn(1, T, 4, generator=g) - 1.0,
        "A": -torch.rand(4, generator=g) * 2, "B": torch.randn(1, T, 2, 16, generator=g) * 0.5,
        "C": torch.randn(1, T, 2, 16, generator=g) * 0.5, "D": torch.randn(4, generator=g),
        "dt_bias": torch.randn(4, generator=g) * 0.1,
    }
    varlen = {"cu_seqlens": local.cu_seqlens, "cu_seqlens_cpu": local.cu_seqlens_cpu, "dt_limit": (0.001, float("inf"))}
    return compare(lambda **a: ops.ssd(**a, **varlen, backend="fla"), lambda **a: reference.ssd(**a, **varlen), inputs)


def case_mixer(name: str, seqlens) -> dict:
    """A whole tiny mixer (see tests/conftest.py), backend ``fla`` against ``reference``, packed input."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from helpers import FAMILIES

    family = FAMILIES[name]
    fla_mixer, ref_mixer = family.build(seed=3, backend="fla"), family.build(seed=3, backend="reference")
    if name != "nemotron_h":
        # GDN's init draws A from [0.01, 16); with A near 16 a 64-token chunk decays by e^-700 and FLA's
        # float32 chunk cumsums lose ~5e-5 on the decay gradients (the reference keeps ~1e-7 against
        # float64). A in [0.14, 1] keeps this case about wiring, not about float32 cancellation.
        with torch.no_grad():
            for mixer in (fla_mixer, ref_mixer):
                mixer.A_log.copy_(torch.linspace(-2.0, 0.0, mixer.A_log.numel()))
    x = 0.5 * torch.randn(1, seqlens.num_tokens, 64, generator=torch.Generator().manual_seed(4))
    result = compare(lambda x: fla_mixer(x, seqlens), lambda x: ref_mixer(x, seqlens), {"x": x})
    params_ref = dict(ref_mixer.named_parameters())
    result["grads"].update({n: scaled_error(p.grad, params_ref[n].grad) for n, p in fla_mixer.named_parameters()})
    return result


def main() -> None:
    seqlens = LayerLocalSeqlens.from_seq_lens(LENS)
    results = {}
    start = time.time()
    with interpreter_shims():
        results["causal_conv1d"] = case_causal_conv1d(seqlens.local())
        results["gated_delta_rule_gva"] = case_gated_delta_rule_gva(seqlens.local())
        # the schedule LayerLocalSeqlens precomputes, handed to FLA's kernels
        local = LayerLocalSeqlens.from_seq_lens(LONG_LENS).local()
        results["causal_conv1d_given_chunk_indices"] = case_causal_conv1d(local, local.chunk_indices)
        results["gated_delta_rule_given_chunk_indices"] = case_gated_delta_rule_gva(local, local.chunk_indices)
        # negative control: a schedule for 128-token chunks is misread by the 64-token kernel
        wrong = chunk_indices_for(local.cu_seqlens_cpu.tolist(), 128).to(torch.int32)
        results["causal_conv1d_wrong_chunk_size"] = case_causal_conv1d(local, wrong)
        results["ssd_on_simple_gla"] = case_ssd_on_simple_gla(seqlens.local())
        results["qwen3_5_moe_mixer"] = case_mixer("qwen3_5_moe", seqlens)
        results["nemotron_h_mixer"] = case_mixer("nemotron_h", seqlens)
    results["total_seconds"] = round(time.time() - start, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

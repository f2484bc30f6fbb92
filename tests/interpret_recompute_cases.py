"""FLA's kernels on CPU (``TRITON_INTERPRET=1``): the sync-free SSD and the padded (static) metadata.

Run by ``tests/test_recompute_interpret.py`` in a fresh process (``TRITON_INTERPRET`` must be set before FLA's
kernels are decorated). Prints one JSON object, per case:

* ``simple_gla_*``: whether :mod:`fla_ac_isolation.fla_seam.simple_gla` (given the schedule, and given a
  padded one) and the saveable ``simple_gla`` operator equal FLA's ``chunk_simple_gla``, output and every
  gradient, bit for bit (``[true, ...]`` per tensor);
* ``syncs_*``: the ops that would synchronise on CUDA (``testing.sync_ops.SyncOpCounter``) in one
  checkpointed layer step (torchtitan's SAC policy) per mode, and in FLA's own ``chunk_simple_gla``;
* ``padded_*``: per layout, the tensors (output, input and parameter gradients) whose values differ between
  static (padded) and ordinary metadata in a checkpointed mixer step (``[]``: bit for bit).

    TRITON_INTERPRET=1 python tests/interpret_recompute_cases.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from helpers import FAMILIES  # noqa: E402

from fla_ac_isolation import LayerLocalSeqlens, StaticSeqlens  # noqa: E402
from fla_ac_isolation.harness.fla_seam.interpreter import interpreter_shims  # noqa: E402
from fla_ac_isolation.harness.modes import SharedSeqlens  # noqa: E402
from fla_ac_isolation.harness.testing.sync_ops import SyncOpCounter  # noqa: E402

LENS = [70, 0, 77, 3]  # 150 tokens: documents across chunk borders, an empty one, a short one
PADDED_LAYOUTS = {"one doc": [150], "the bound": [1, 1, 60, 0, 88, 0]}  # LENS is the static buffers' first
MAX_DOCS = 6


def _offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _run(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape)).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    return [torch.equal(x, y) for x, y in zip(a, b, strict=True)]


def case_simple_gla() -> dict:
    from fla.ops.simple_gla import chunk_simple_gla

    from fla_ac_isolation.fla_seam.simple_gla import simple_gla

    g = torch.Generator().manual_seed(0)
    tokens, heads = sum(LENS), 2
    inputs = [torch.randn(1, tokens, heads, 16, generator=g), torch.randn(1, tokens, heads, 16, generator=g),
              torch.randn(1, tokens, heads, 8, generator=g), -torch.rand(1, tokens, heads, generator=g)]
    cu = _offsets(LENS)
    fla = _run(lambda q, k, v, gg: chunk_simple_gla(q, k, v, gg, scale=1.0, cu_seqlens=cu.clone())[0], inputs)
    local = LayerLocalSeqlens(cu).local()
    given = _run(lambda *t: simple_gla(*t, 1.0, local.cu_seqlens, local.chunk_indices, local.chunk_offsets), inputs)
    static = StaticSeqlens(tokens, MAX_DOCS, device="cpu")
    static.fill(cu)
    padded = static.local()
    pad = _run(lambda *t: simple_gla(*t, 1.0, padded.cu_seqlens, padded.chunk_indices, padded.chunk_offsets), inputs)
    op = _run(lambda *t: torch.ops.fla_ac_isolation.simple_gla(*t, 1.0, local.cu_seqlens, None, local.chunk_indices,
                                                               local.chunk_offsets)[0], inputs)
    batch = [t.reshape(2, tokens // 2, *t.shape[2:]) for t in inputs]  # two rows, no offsets
    fla_batch = _run(lambda q, k, v, gg: chunk_simple_gla(q, k, v, gg, scale=1.0)[0], batch)
    ours_batch = _run(lambda *t: simple_gla(*t, 1.0, None, None, None), batch)
    return {"simple_gla_given_schedule": _equal(given, fla), "simple_gla_padded_schedule": _equal(pad, fla),
            "simple_gla_operator": _equal(op, fla), "simple_gla_batch_rows": _equal(ours_batch, fla_batch)}


def _checkpointed(layer: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from fla_ac_isolation.policies import sac_context_fn, torchtitan_selective

    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              context_fn=sac_context_fn(torchtitan_selective()))


def case_syncs() -> dict:
    from fla.ops.simple_gla import chunk_simple_gla

    results = {}
    x = torch.randn(1, sum(LENS), 64, generator=torch.Generator().manual_seed(1))
    for name in ("qwen3_5_moe", "nemotron_h"):
        layer = FAMILIES[name].build(0, seed=0, backend="fla")
        modes = {"isolated": (_checkpointed(layer), lambda: LayerLocalSeqlens.from_seq_lens(LENS))}
        if name == "nemotron_h":
            modes["shared"] = (_checkpointed(layer), lambda: SharedSeqlens.from_seq_lens(LENS, with_cpu=False))
            modes["no-ac"] = (layer, lambda: SharedSeqlens.from_seq_lens(LENS, with_cpu=False))
        for mode, (module, make) in modes.items():
            seqlens = make()  # built outside the count, as a loader builds it
            with SyncOpCounter() as counter:
                module(x.clone().requires_grad_(), seqlens).square().mean().backward()
            results[f"syncs_{name}_{mode}"] = counter.flagged
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, sum(LENS), 2, 16, generator=g).requires_grad_() for _ in range(3))
    gate = (-torch.rand(1, sum(LENS), 2, generator=g)).requires_grad_()
    cu = _offsets(LENS)
    with SyncOpCounter() as counter:
        chunk_simple_gla(q, k, v, gate, scale=1.0, cu_seqlens=cu)[0].sum().backward()
    results["syncs_fla_chunk_simple_gla"] = counter.flagged
    return results


def case_padded() -> dict:
    results = {}
    tokens = sum(LENS)
    for name in ("qwen3_5_moe", "nemotron_h"):
        layer = _checkpointed(FAMILIES[name].build(0, seed=0, backend="fla"))
        names = ["out", "x", *(n for n, _ in layer.named_parameters())]
        static = StaticSeqlens(tokens, MAX_DOCS, device="cpu")
        static.fill(_offsets(LENS))  # an earlier batch in the same buffers
        x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(3))
        for label, lens in PADDED_LAYOUTS.items():
            runs = []
            static.fill(_offsets(lens))
            for seqlens in (static, LayerLocalSeqlens(_offsets(lens))):
                layer.zero_grad(set_to_none=True)
                runs.append(_run(lambda t, s=seqlens, m=layer: m(t, s), [x]) + [p.grad for p in layer.parameters()])
            results[f"padded_{name}_{label}"] = [n for n, same in zip(names, _equal(*runs), strict=True) if not same]
    return results


def main() -> None:
    results = {}
    start = time.time()
    with interpreter_shims():
        results.update(case_simple_gla())
        results.update(case_syncs())
        results.update(case_padded())
    results["total_seconds"] = round(time.time() - start, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""FLA's real Triton kernels as the saveable custom operators, on CPU (``TRITON_INTERPRET=1``).

Run by ``tests/test_saveable_interpret.py`` in a fresh process (``TRITON_INTERPRET`` must be set before FLA's
kernels are decorated). One 2-layer stack (a Qwen3.5 GDN and a Nemotron-H Mamba2 mixer, ``backend="fla"``)
covers the three operators as the mixers call them (the conv on a strided view; the gated delta rule with
GVA on views of one tensor; simple GLA with grouped ``B``/``C``), in bfloat16 so that the fake kernels'
dtypes are checked (bf16 outputs next to fp32 cumsums and norms). Prints one JSON object:

* ``parity``: the stack's loss and every gradient without AC, ``saveable=True`` against the default path
  (FLA's public functions), bit-equal (``torch.equal``);
* ``fake``: every operator call of that run (forward and backward operators) repeated under
  ``FakeTensorMode``: same shapes, strides and dtypes;
* ``sac``: the stack under ``any_of(save_fla_ops(("gated_delta_rule", "ssd")), save_device_to_host_copies())``:
  bit-equal to no AC; operator forward calls, interpreted kernel launches and FLA cache lookups in the
  recompute (those inside backward operators excluded);
* ``compile``: ``torch._dynamo.explain`` graph and break counts of the GDN mixer with ``saveable=True``;
* per-section and total seconds.

    TRITON_INTERPRET=1 python tests/interpret_saveable_cases.py
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from helpers import FAMILIES, HIDDEN, Block, OpRecorder  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fla_ac_isolation.fla_seam.cache import clear_tensor_cache, probe_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.fla_seam.interpreter import interpreter_shims  # noqa: E402
from fla_ac_isolation.policies import any_of, checkpoint_layers, save_device_to_host_copies, save_fla_ops  # noqa: E402
from fla_ac_isolation.seqlens import LayerLocalSeqlens  # noqa: E402

LENS = [70, 0, 30, 3]  # T = 103: a two-chunk document, a zero-length and a 3-token one
LAUNCHES: collections.Counter = collections.Counter()
RECORDING: list = []  # the OpRecorder of the backward being recorded, if any


def _count_launches() -> None:
    """Count interpreted kernel launches made in a recorded backward outside backward operators."""
    import triton.runtime.interpreter as interpreter

    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and RECORDING and not RECORDING[0].in_backward_op:
            LAUNCHES[self.fn.__name__] += 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run


def _bit_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class _CaptureOps(TorchDispatchMode):
    """Records every ``fla_ac_isolation`` operator call (op, args, real outputs) made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.startswith("fla_ac_isolation::"):
            self.calls.append((func, args, out))
        return out


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def fake_vs_real(calls: list) -> dict[str, bool]:
    """Each captured call repeated under FakeTensorMode: per operator, do all outputs' metadata match?"""
    res: dict[str, bool] = {}
    for op, args, real in calls:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real, fake = (t if isinstance(t, (tuple, list)) else (t,) for t in (real, fake))
        same = len(real) == len(fake) and all(_meta(r) == _meta(f) for r, f in zip(real, fake))
        name = op._schema.name.split("::")[1]
        res[name] = res.get(name, True) and same
    return res


def _stack(saveable: bool) -> nn.ModuleList:
    layers = nn.ModuleList()
    for i, family in enumerate(("qwen3_5_moe", "nemotron_h")):
        mixer = FAMILIES[family].build(layer_idx=i, seed=10 + i, backend="fla", saveable=saveable)
        if family != "nemotron_h":  # keep GDN's decay moderate (see interpret_cases.case_mixer)
            with torch.no_grad():
                mixer.A_log.copy_(torch.linspace(-2.0, 0.0, mixer.A_log.numel()))
        layers.append(Block(mixer))
    return layers.to(torch.bfloat16)


def _stack_step(policy=None, saveable=True, capture=None) -> dict:
    layers = _stack(saveable)
    if policy is not None:
        checkpoint_layers(layers, mode="selective", policy=policy)
    x = 0.5 * torch.randn(1, sum(LENS), HIDDEN, generator=torch.Generator().manual_seed(4))
    h = x.to(torch.bfloat16).requires_grad_()
    clear_tensor_cache()
    with capture if capture is not None else contextlib.nullcontext():
        out = h
        for layer in layers:
            out = layer(out, LayerLocalSeqlens.from_seq_lens(LENS))
        loss = out.float().pow(2).mean()
        LAUNCHES.clear()
        with probe_tensor_cache() as probe, OpRecorder(probe) as recorder:
            RECORDING.append(recorder)
            try:
                loss.backward()
            finally:
                RECORDING.clear()
    return {"grads": [loss.detach(), h.grad] + [p.grad for p in layers.parameters()],
            "recompute_calls": recorder.forward_calls, "recompute_launches": dict(LAUNCHES),
            "recompute_lookups": sum(len(e) for e in recorder.forward_events.values()) + len(recorder.outside)}


def parity_fake_and_sac() -> dict:
    capture = _CaptureOps()
    no_ac = _stack_step(capture=capture)
    res = {"parity": _bit_equal(_stack_step(saveable=False)["grads"], no_ac["grads"]),
           "fake": fake_vs_real(capture.calls)}
    step = _stack_step(any_of(save_fla_ops(("gated_delta_rule", "ssd")), save_device_to_host_copies()))
    res["sac"] = {"bit_equal": _bit_equal(step["grads"], no_ac["grads"]), **{k: v for k, v in step.items() if k != "grads"}}
    return res


def compile_breaks() -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    x = 0.5 * torch.randn(1, sum(LENS), HIDDEN, generator=torch.Generator().manual_seed(4))
    mixer = FAMILIES["qwen3_5_moe"].build(seed=3, backend="fla", saveable=True)
    explained = torch._dynamo.explain(mixer)(x, LayerLocalSeqlens.from_seq_lens(LENS))
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count}


def main() -> None:
    torch.set_num_threads(1)
    _count_launches()
    start = time.time()
    results = {}
    with interpreter_shims():
        t0 = time.time()
        results.update(parity_fake_and_sac())
        results["stack_seconds"] = round(time.time() - t0, 1)
        t0 = time.time()
        results["compile"] = compile_breaks()
        results["compile_seconds"] = round(time.time() - t0, 1)
    results["total_seconds"] = round(time.time() - start, 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

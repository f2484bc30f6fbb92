"""Shared test support: tiny configs and models of every family, batches, runs, expected fault outcomes.

Every test file imports what it shares from here (never from ``conftest`` or another test file);
``conftest.py`` only holds fixtures. The families come from the library's one registry,
:data:`fla_ac_isolation.families.FAMILIES`; this module adds tiny configs and test-only runners.

Sections: mixer cases (``FAMILIES``: one per upstream class, tiny configs), whole transformers models for
the swap tests (``MODEL_FAMILIES``), the fault matrix's policies and expected outcomes, run helpers,
scripts loaded by path and interpreter subprocesses (``load_script``, ``run_interpreter_cases``), ``Block``.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    DataCollatorWithFlattening,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from fla_ac_isolation import families
from fla_ac_isolation.ops import reference
from fla_ac_isolation.policies import any_of, sac_context_fn, save_all_copies, save_ops

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

# ================================================================================== mixer cases
HIDDEN = 64
PACKED_LENS = [5, 0, 17, 1, 41]  # zero-length and one-token documents on purpose


def qwen3_5_moe_config():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_gdn_fields(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32)


def qwen3_5_config():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_gdn_fields(), intermediate_size=128)


def qwen3_8_config(output_gate_type: str | None = "sigmoid"):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**_gdn_fields(), output_gate_type=output_gate_type, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def nemotron_h_config():
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    return NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, use_conv_bias=True, layers_block_type=["linear_attention"] * 4, num_hidden_layers=4,
    )


def _gdn_fields() -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4, layer_types=["linear_attention"] * 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
    )


@dataclass(frozen=True)
class MixerFamily:
    """One mixer test case: a library family, the upstream (transformers) class, a tiny config builder."""

    name: str
    family: families.Family   # the library's registry entry
    upstream: families.UpstreamMixer
    config: Any               # () -> config

    @property
    def ours(self) -> str:
        """Our class name in fla_ac_isolation.mixers."""
        return self.family.mixer

    @property
    def hf_module(self) -> str:
        return self.upstream.module

    @property
    def hf_class(self) -> str:
        return self.upstream.name

    def build(self, layer_idx: int = 0, seed: int = 0, **kwargs):
        torch.manual_seed(seed)
        mixer = self.family.mixer_class()(self.config(), layer_idx, **kwargs)
        _randomize(mixer, seed)
        return mixer

    def build_hf(self, layer_idx: int = 0):
        return self.upstream.resolve()(self.config(), layer_idx)


def _case(name: str, family: str, upstream: int, config) -> MixerFamily:
    entry = families.FAMILIES[family]
    return MixerFamily(name, entry, entry.upstream[upstream], config)


FAMILIES = {
    f.name: f
    for f in (
        _case("qwen3_5_moe", "qwen3_5_moe", 0, qwen3_5_moe_config),
        _case("qwen3_5", "qwen3_5_moe", 1, qwen3_5_config),  # dense Qwen3.5: same mixer class
        _case("qwen3_8", "qwen3_8", 0, qwen3_8_config),
        _case("nemotron_h", "nemotron_h", 0, nemotron_h_config),
    )
}
"""Mixer test cases: one per upstream class of :data:`fla_ac_isolation.families.FAMILIES`."""
# One per mixer class (the dense Qwen3.5 config runs through the same class as Qwen3.5-MoE).
CORE_FAMILIES = ["qwen3_5_moe", "qwen3_8", "nemotron_h"]


@torch.no_grad()
def _randomize(mixer: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for the parameters that init leaves constant (norm weights, biases, D)."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in mixer.named_parameters():
        if name.endswith("norm.weight") or name == "D":
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


# transformers' kernel-or-torch functions: decorated at import with FLA / causal_conv1d / mamba_ssm when
# importable; `__wrapped__` (functools.wraps) is the plain torch function the decorator fell back from.
HF_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_split_conv1d_scan_combined",
    "mamba2_selective_state_update",
    "mamba2_chunk_scan",
)


def split_documents(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    """``x [1, T, ...]`` cut into its non-empty documents ``[1, L, ...]``."""
    out, start = [], 0
    for n in lens:
        if n:
            out.append(x[:, start:start + n])
        start += n
    return out


def loss_and_grads(layers: torch.nn.ModuleList, x: torch.Tensor, seqlens: Any):
    """Run ``x`` through ``layers`` (each called as ``layer(h, seqlens)``), backward ``mean(out.float() ** 2)``.

    Returns ``(loss, dx, grads)``: the detached loss, the gradient of ``x`` (run on a fresh leaf, ``x`` itself is
    untouched) and ``{parameter name: grad}`` with checkpoint_wrapper's ``_checkpoint_wrapped_module.`` dropped
    from the names, so a checkpointed and an unwrapped stack compare name by name.
    """
    h = x.clone().requires_grad_()
    out = h
    for layer in layers:
        out = layer(out, seqlens)
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in layers.named_parameters()}
    return loss.detach(), h.grad, grads

# ================================================================ whole transformers models (swap tests)
aten = torch.ops.aten
VOCAB = 128
DOC_LENS = (70, 23, 41)  # 134 packed tokens; the first document spans two 64-token chunks


# ------------------------------------------------------------------------------------------- builders
def _qwen_fields(**extra):
    return dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, attn_implementation="sdpa", **extra,
    )


def _qwen3_5_moe() -> nn.Module:
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    layers = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_qwen_fields(layer_types=layers, **moe)))


def _qwen3_5_dense() -> nn.Module:
    layers = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_qwen_fields(layer_types=layers, intermediate_size=96)))


def _qwen3_8_flash_next() -> nn.Module:
    config = Qwen4ExpTextConfig(
        **_qwen_fields(
            layer_types=["linear_attention"] * 3 + ["indexed_attention"],
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            hc_count=2, hc_lowrank=8,
            # an indexed-attention layer needs every QSA indexer field
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        )
    )
    return Qwen4ExpForCausalLM(config)


def _nemotron_h() -> nn.Module:
    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, ssm_state_size=16,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16, attn_implementation="sdpa",
    )
    return NemotronHForCausalLM(config)


@dataclass(frozen=True)
class ModelFamily:
    """A tiny transformers model of one upstream mixer class, and where its mixers sit."""

    build: Callable[[], nn.Module]
    upstream: families.UpstreamMixer  # the transformers mixer class (the library's registry)
    ours: type  # our drop-in
    paths: tuple[str, ...]  # mixer paths in the tiny model

    @property
    def modeling(self) -> str:
        """The transformers modeling module of the family."""
        return self.upstream.module

    @property
    def hf_mixer(self) -> str:
        """The transformers mixer class name."""
        return self.upstream.name

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.build()
        model.train()
        return model


def _model_family(build, family: str, upstream: int, paths: tuple[str, ...]) -> ModelFamily:
    entry = families.FAMILIES[family]
    return ModelFamily(build, entry.upstream[upstream], entry.mixer_class(), paths)


_GDN_PATHS = tuple(f"model.layers.{i}.linear_attn" for i in range(3))
MODEL_FAMILIES = {
    "qwen3_5_moe": _model_family(_qwen3_5_moe, "qwen3_5_moe", 0, _GDN_PATHS),
    "qwen3_8_flash_next": _model_family(_qwen3_8_flash_next, "qwen3_8", 0, _GDN_PATHS),
    "nemotron_h": _model_family(_nemotron_h, "nemotron_h", 0, ("model.layers.0.mixer", "model.layers.2.mixer")),
}
DENSE = _model_family(_qwen3_5_dense, "qwen3_5_moe", 1, _GDN_PATHS)
ALL_MODEL_FAMILIES = {**MODEL_FAMILIES, "qwen3_5_dense": DENSE}
QWEN = [name for name in MODEL_FAMILIES if name != "nemotron_h"]


# ------------------------------------------------------------------------------------ which path ran
@contextlib.contextmanager
def hf_torch_fallback(family: ModelFamily) -> Iterator[None]:
    """Make transformers' mixers of ``family`` run transformers' pure-torch GDN, as without FLA installed.

    transformers' decorator ``use_kernel_func_from_hub_with_fallback`` picks FLA when ``import fla``
    succeeds; re-applying it to the undecorated torch function while ``sys.modules["fla"] is None`` yields
    the wrapper transformers builds without FLA (torch function, refusing ``cu_seqlens``). Nemotron-H's
    functions already fall back (no mamba_ssm here), so nothing changes for it.
    """
    modeling = importlib.import_module(family.modeling)
    names = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}
    saved = {name: getattr(modeling, name) for name in names if hasattr(modeling, name)}
    hidden = sys.modules.get("fla")
    sys.modules["fla"] = None  # `import fla` raises ImportError while transformers resolves the kernel
    try:
        for name, fn in saved.items():
            setattr(modeling, name, use_kernel_func_from_hub_with_fallback(names[name], "fla")(inspect.unwrap(fn)))
    finally:
        sys.modules["fla"] = hidden
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)


def _fla_chunk_gated_delta_rule_on_cpu(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """FLA's ``chunk_gated_delta_rule`` as transformers calls it, computed by our reference backend.

    The reference asks FLA's index helpers for its chunk schedule with the arguments FLA's kernel passes,
    so FLA's identity cache sees the same hits and misses as on a GPU.
    """
    assert initial_state is None and not output_final_state  # training: no cache
    out = reference.chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens
    )
    return out, None


@contextlib.contextmanager
def hf_fla_kernel_on_cpu(family: ModelFamily) -> Iterator[None]:
    """Run transformers' Qwen GDN with its FLA call served on CPU by :func:`_fla_chunk_gated_delta_rule_on_cpu`."""
    modeling = importlib.import_module(family.modeling)
    saved = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = _fla_chunk_gated_delta_rule_on_cpu
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = saved


# --------------------------------------------------------------------------------------- batches, runs
def documents(seed: int = 0, lens=DOC_LENS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lens]


def packed_batch(seed: int = 0, lens=DOC_LENS) -> dict:
    """A fresh packed batch (new tensor objects every call, as a data loader gives every step)."""
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(documents(seed, lens))
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    return dict(batch)


def unpacked_batch(seed: int = 0, batch: int = 2, tokens: int = 80) -> dict:
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def set_checkpointing(model: nn.Module, policy) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 calls these deprecated aliases
        if policy is None:
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac_context_fn(policy)}
            )


@dataclass
class Step:
    loss: torch.Tensor | None = None
    grads: dict | None = None
    error: BaseException | None = None


def train_step(model: nn.Module, batch: dict) -> Step:
    """One forward + backward on ``batch``; an exception is returned, not raised."""
    model.zero_grad(set_to_none=True)
    try:
        out = model(**batch, use_cache=False)
        out.loss.backward()
    except Exception as err:
        return Step(error=err)
    grads = {  # named as in state_dict(), also under torch's checkpoint_wrapper
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return Step(out.loss.detach().clone(), grads)


def max_grad_diff(a: Step, b: Step) -> float:
    assert a.grads.keys() == b.grads.keys()
    return max((a.grads[n] - b.grads[n]).abs().max().item() for n in a.grads)


def logits_of(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits


SWAP_POLICIES = {
    "save-all-copies": save_all_copies,  # FLA's int32 miss path casts with _to_copy
    "save-int-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.int32, torch.int64]),
}


# ================================================================= how the unsafe shared path must end
@dataclass(frozen=True)
class SharedOutcome:
    """The exact outcome a control of the unsafe shared path must show: never "any exception".

    Either ``error`` (an exception class) whose message contains ``message``, or ``error=None`` and a
    largest gradient difference to the reference above ``floor``.
    """

    error: type[BaseException] | None
    message: str = ""
    floor: float = 0.0

    def check(self, error: BaseException | str | None, grad_diff: float | None = None) -> None:
        """Assert the outcome; ``error`` is the exception, or its ``"<Type>: <message>"`` text (examples)."""
        if self.error is None:
            assert error is None, f"expected gradients off by > {self.floor}, got an error: {error}"
            assert grad_diff is not None and grad_diff > self.floor, f"max |grad diff| {grad_diff} <= {self.floor}"
            return
        assert error is not None, f"expected {self.error.__name__}: {self.message}, got no error"
        if isinstance(error, str):
            kind, _, text = error.partition(": ")
            assert kind == self.error.__name__ and self.message in text, f"got {error!r}"
        else:
            assert type(error) is self.error and self.message in str(error), f"got {type(error).__name__}: {error}"


def raise_unrelated(ctx, op, *args, **kwargs):
    """A SAC policy that fails for a reason unrelated to the fault: controls must not accept it."""
    raise RuntimeError("unrelated failure inside the SAC policy")


#: transformers' own Qwen GDN (FLA's cache behaviour, see ``hf_fla_kernel_on_cpu``), one shared
#: ``cu_seq_lens_q``, under each swap policy (torch 2.13, FLA 0.6.0, CPU): the forward's cache miss and the
#: recompute's hit shift SAC's replay; the MoE's expert histogram (``histc``) then receives one of FLA's
#: int32 tensors (save-all-copies), or autograd an int tensor saved in place of a float one (save-int-sub).
UNSWAPPED_QWEN_UNDER_SAC = {
    "save-all-copies": SharedOutcome(NotImplementedError, "\"histogram_cpu\" not implemented for 'Int'"),
    "save-int-sub": SharedOutcome(RuntimeError, "Autograd not support dtype: Int"),
}

# ====================================================================== the fault matrix (fault stack)
FAULT_POLICIES = {
    "save-all-copies": save_all_copies,
    "save-int-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.int32, torch.int64]),
    "save-float-sub": lambda: save_ops([aten.sub.Tensor], dtypes=[torch.float32]),
    "save-copies-and-clone": lambda: any_of(save_all_copies(), save_ops([aten.clone.default, aten.alias.default])),
    "full-ac": lambda: None,
}


def expected_shared_outcome(policy: str, dtype: torch.dtype, cache_size: int) -> str:
    """What the unsafe shared path does, worked out from which ops FLA's helpers run on a miss.

    On a miss, prepare_position_ids/prepare_chunk_indices run three integer ``sub``s, and two ``_to_copy``
    casts only when cu_seqlens is int32 (their results are int64). A recompute that skips them shifts
    SAC's (op, index) replay of those ops; a recompute that adds them meets ops the forward never ran.
    """
    if policy == "full-ac":
        return "match"  # plain AC replays nothing by op index: immune
    if cache_size == 1:
        return "raise:encountered during backward but not found in storage"  # recompute runs extra ops
    if policy == "save-int-sub":
        return "raise:Autograd not support dtype"  # an FLA int tensor replaces the layer's own int sub
    if policy == "save-float-sub":
        return "silent"  # 3 skipped int subs shift the 4 float subs: the 4th replays the 1st's value
    if dtype == torch.int64:
        return "match"  # no _to_copy on the miss path for int64 offsets: nothing to shift
    return "raise:The size of tensor a"  # the layer's own int->float cast receives FLA's int32 positions


MATRIX = [
    pytest.param(policy, dtype, size, early_stop, freq, id=f"{policy}-{str(dtype)[6:]}-cache{size}-es{int(early_stop)}-freq{freq}")
    for policy in FAULT_POLICIES
    for dtype in (torch.int32, torch.int64)
    for size in (4, 1)
    for early_stop in (True, False)
    for freq in (1, 2)
]


# ============================================================ scripts and subprocesses
ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str):
    """A script of ``examples/`` or ``benchmarks/`` (not packages) loaded from ``path`` as module ``name``.

    Registered in ``sys.modules`` before it runs: dataclasses look their module up while a class is created.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_interpreter_cases(script: str, timeout_s: float) -> dict:
    """Run ``tests/<script>`` in a subprocess under ``TRITON_INTERPRET=1`` and one OpenMP thread; its JSON.

    The variable must be set before FLA's kernels are decorated, i.e. before this test session imported
    FLA, hence the subprocess. The script prints one JSON document as its last line of stdout.
    """
    path = Path(__file__).with_name(script)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ============================================================ stacks of mixers
class Block(nn.Module):
    """A residual block ``x + mixer(x, seqlens)``: the unit the SAC tests checkpoint."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor, seqlens: Any) -> torch.Tensor:
        return x + self.mixer(x, seqlens)


# ============================================================ saveable ops (FLA calls as custom operators)
def saveable_op_names() -> dict[Any, str]:
    """``{forward overload: operation name}`` for both backends (``ops.SAVEABLE_OPS`` inverted)."""
    from fla_ac_isolation.ops import SAVEABLE_OPS

    return {overload: name for name, overloads in SAVEABLE_OPS.items() for overload in overloads}


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of the saveable custom operators and the FLA cache events made inside each.

    Enter it around a forward or a backward (inside ``probe_tensor_cache()`` as ``probe``). Under SAC the
    checkpoint's own dispatch mode sits above this one, so an op whose output SAC saved never reaches it in
    the recompute. ``forward_calls[name]``/``forward_events[name]``: calls of operation ``name``'s forward
    operator (in a backward pass: its recompute) and the cache events made inside them;
    ``backward_calls[name]``: calls of its backward operator; ``outside``: cache events made outside any of
    these operators; ``in_backward_op``: true while a backward operator runs (to attribute other events).
    """

    def __init__(self, probe: Any) -> None:
        super().__init__()
        self.probe = probe
        self.names = saveable_op_names()
        self.forward_calls: dict[str, int] = {}
        self.forward_events: dict[str, list] = {}
        self.backward_calls: dict[str, int] = {}
        self.in_backward_op = False
        self._inside: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.name
        if not schema.startswith("fla_ac_isolation::"):
            return func(*args, **kwargs)
        start = self.probe.mark()
        self.in_backward_op = func not in self.names
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_backward_op = False
        self._inside.append((start, self.probe.mark()))
        if func in self.names:
            name = self.names[func]
            self.forward_calls[name] = self.forward_calls.get(name, 0) + 1
            self.forward_events.setdefault(name, []).extend(self.probe.events[start:])
        else:
            name = next(n for f, n in self.names.items() if schema == f._schema.name + "_backward")
            self.backward_calls[name] = self.backward_calls.get(name, 0) + 1
        return out

    @property
    def outside(self) -> list:
        inside = {i for start, end in self._inside for i in range(start, end)}
        return [e for i, e in enumerate(self.probe.events) if i not in inside]


@dataclass
class RecordedStep:
    """One forward + backward of a stack: the numbers, and what the saveable ops did in each pass."""

    loss: torch.Tensor
    dx: torch.Tensor
    grads: dict[str, torch.Tensor]
    forward: OpRecorder
    backward: OpRecorder


def recorded_step(layers: nn.ModuleList, x: torch.Tensor, seqlens: Any) -> RecordedStep:
    """:func:`loss_and_grads` with an :class:`OpRecorder` (and a cache probe) around the forward and the backward."""
    from fla_ac_isolation.fla_cache import clear_tensor_cache, probe_tensor_cache

    clear_tensor_cache()
    h = x.clone().requires_grad_()
    with probe_tensor_cache() as probe, OpRecorder(probe) as forward:
        out = h
        for layer in layers:
            out = layer(out, seqlens)
        loss = out.float().pow(2).mean()
    with probe_tensor_cache() as probe, OpRecorder(probe) as backward:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in layers.named_parameters()}
    return RecordedStep(loss.detach(), h.grad, grads, forward, backward)


def assert_bit_equal(got: Any, want: Any) -> None:
    """Loss, input gradient and every parameter gradient of two steps are equal bit for bit."""
    assert torch.equal(got.loss, want.loss), (got.loss, want.loss)
    assert torch.equal(got.dx, want.dx)
    assert got.grads.keys() == want.grads.keys()
    for name, grad in want.grads.items():
        assert torch.equal(got.grads[name], grad), name


# ============================================================ SAC storage (what a policy saved)
def sac_forward_storages(policy: Any, run: Callable[[Callable], Any]) -> list[dict]:
    """SAC's storage (``{op: {invocation index: saved outputs or a recompute marker}}``) of every
    checkpointed region that ``run(context_fn)`` runs forward with ``context_fn = sac_context_fn(policy)``,
    in region order; read it before any backward consumes it."""
    storages = []

    def context_fn():
        forward_ctx, recompute_ctx = sac_context_fn(policy)()
        storages.append(forward_ctx.storage)
        return forward_ctx, recompute_ctx

    run(context_fn)
    return storages


def saved_indices(storage: dict, op: Any) -> list[int]:
    """Invocation indices of ``op`` whose outputs SAC saved in one region's ``storage``."""
    return sorted(i for i, entry in storage.get(op, {}).items() if _saved(entry))


def _saved(entry: Any) -> bool:
    first = entry[0] if isinstance(entry, (tuple, list)) else entry
    return hasattr(first, "val")


def sac_storage_bytes(policy: Any, run: Callable[[Callable], Any]) -> dict[str, int]:
    """Bytes SAC holds after a checkpointed forward, per op name: what ``policy`` saved, read from SAC's storage.

    See :func:`sac_forward_storages` for ``run``. Each tensor storage is counted once, whole (a saved view
    keeps its base alive).
    """
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for storage in sac_forward_storages(policy, run):
        for func, entries in storage.items():
            for entry in entries.values():
                for wrapped in (entry if isinstance(entry, (tuple, list)) else [entry]):
                    value = getattr(wrapped, "val", None)
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                        seen.add(value.untyped_storage().data_ptr())
                        name = func._schema.name.split("::")[-1]
                        sizes[name] = sizes.get(name, 0) + value.untyped_storage().nbytes()
    return sizes


# ============================================================= foreign models (isolate_seqlens, OLMo-core swap)
# OLMo-core and torchtitan are imported inside the functions: the GPU image may lack them (importorskip).
INT_REPLAY = "Autograd not support dtype: Int"  # what SAC's misreplay of FLA's int tensors raises (torch 2.13)
OLMO_PATTERN = ("gdn", "attn")  # one GDN block is enough for the fault (FLA's cache holds 4 entries)
OLMO_AC_MODES = ("full", "selected_blocks", "selected_modules", "selected_ops")


def olmo_hybrid(pattern: tuple[str, ...] = OLMO_PATTERN, seed: int = 0, device: str = "cpu") -> nn.Module:
    """OLMo-core's own ``Transformer`` from ``TransformerConfig.qwen3_5_like`` (its hybrid recipe), tiny, fp32.

    Blocks follow ``pattern``: ``"gdn"`` (``GatedDeltaNet``), ``"attn"`` (full attention, torch backend),
    ``"kda"`` (``KimiDeltaAttention``) or ``"mamba"`` (``NemotronMamba2Mixer``, fp32). Norm weights are
    perturbed so gradients are generic. The torch backend needs
    :func:`~fla_ac_isolation.testing.olmo_core.packed_attention_on_torch_backend` for packed documents.
    """
    from olmo_core.config import DType
    from olmo_core.nn.attention.kda import KimiDeltaAttentionConfig
    from olmo_core.nn.attention.recurrent import NemotronMamba2Config
    from olmo_core.nn.transformer.config import TransformerBlockConfig, TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "n_layers is not divisible by the length of block_pattern"
        config = TransformerConfig.qwen3_5_like(
            d_model=64, vocab_size=VOCAB, n_layers=len(pattern), n_heads=4, n_kv_heads=2, head_dim=16,
            intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, attn_backend="torch",
        )
    gdn = config.block["gdn"]
    extra = {
        "kda": KimiDeltaAttentionConfig(n_heads=2, head_dim=16),
        "mamba": NemotronMamba2Config(ssm_state_size=16, conv_kernel=4, mamba_num_heads=4, mamba_head_dim=16,
                                      n_groups=2, chunk_size=16, dtype=DType.float32),
    }
    config.block = {**config.block, **{
        name: TransformerBlockConfig(name=gdn.name, sequence_mixer=mixer, feed_forward=gdn.feed_forward,
                                     layer_norm=gdn.layer_norm)
        for name, mixer in extra.items()
    }}
    config.block_pattern = list(pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = config.build(init_device=device)
    torch.manual_seed(seed)
    model.init_weights(device=torch.device(device), max_seq_len=256)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen).to(p.device))
    return model.train()


def olmo_batch(seed: int = 1, lens=DOC_LENS, device: str = "cpu") -> dict:
    """A packed OLMo-core batch: ``input_ids``/``labels`` ``[1, T]``, ``doc_lens`` ``[1, N]``, ``max_doc_lens``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    return {
        "input_ids": torch.randint(0, VOCAB, (1, tokens), generator=gen).to(device),
        "labels": torch.randint(0, VOCAB, (1, tokens), generator=gen).to(device),
        "doc_lens": torch.tensor([list(lens)], device=device),
        "max_doc_lens": [max(lens)],
    }


def olmo_policy_plus_to_copy():
    """OLMo-core's own ``selected_ops`` policy (every 2nd ``mm``, SDPA, ...) that also saves every ``_to_copy``."""
    from olmo_core.nn.utils import _get_custom_checkpoint_policy
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def context_fn():
        base = _get_custom_checkpoint_policy(collections.defaultdict(int))

        def policy(ctx, func, *args, **kwargs):
            if func is aten._to_copy.default:
                return CheckpointPolicy.MUST_SAVE
            return base(ctx, func, *args, **kwargs)

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def olmo_apply_ac(model: nn.Module, mode: str) -> None:
    """OLMo-core's own ``Transformer.apply_activation_checkpointing`` (what its ``parallelize_model`` calls).

    ``mode``: an OLMo-core mode (``selected_blocks`` every block, ``selected_modules`` on
    ``blocks.*.attention``, the sequence mixers) or ``"selected_ops+to_copy"``: OLMo-core's
    ``selected_ops`` with its module-level ``selective_checkpointing_context_fn`` replaced by
    :func:`olmo_policy_plus_to_copy` for the call (OLMo-core reads that global when it wraps).
    """
    import olmo_core.nn.transformer.model as olmo_model
    from olmo_core.nn.transformer.config import TransformerActivationCheckpointingMode as Mode

    if mode == "selected_ops+to_copy":
        saved = olmo_model.selective_checkpointing_context_fn
        olmo_model.selective_checkpointing_context_fn = olmo_policy_plus_to_copy()
        try:
            model.apply_activation_checkpointing(Mode.selected_ops)
        finally:
            olmo_model.selective_checkpointing_context_fn = saved
    elif mode == "selected_blocks":
        model.apply_activation_checkpointing(Mode.selected_blocks, block_interval=1)
    elif mode == "selected_modules":
        model.apply_activation_checkpointing(Mode.selected_modules, modules=["blocks.*.attention"])
    else:
        model.apply_activation_checkpointing(Mode(mode))


def olmo_step(model: nn.Module, batch: dict, bf16: bool = False) -> Step:
    """One forward + backward as OLMo-core's train module runs it (autocast around the forward only).

    FLA's cache is cleared first, so every step starts from the same cache state. An exception is returned.
    """
    from fla_ac_isolation.fla_cache import clear_tensor_cache

    clear_tensor_cache()
    model.zero_grad(set_to_none=True)
    device = batch["input_ids"].device.type
    autocast = torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    try:
        with autocast:
            out = model(batch["input_ids"], labels=batch["labels"], doc_lens=batch["doc_lens"],
                        max_doc_lens=batch["max_doc_lens"])
        out.loss.backward()
    except Exception as err:
        return Step(error=err)
    return Step(out.loss.detach().clone(), _grads(model))


def _grads(model: nn.Module) -> dict:
    """``{name: grad}``, names without wrappers' segments; DTensor (FSDP2) gradients as full tensors."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for wrapper in ("._checkpoint_wrapped_module", "._orig_mod"):
            name = name.replace(wrapper, "")
        grads[name] = grad.clone()
    return grads


def divergent(audit) -> list[tuple[str, list[str]]]:
    """``[(region, [FLA helpers whose cache state differed])]`` of a ReplayAudit's divergent regions."""
    return [(r.label, [d.helper for d in r.fla]) for r in audit.divergent]


TITAN_QWEN3_5_NEEDS = "torch.distributed.fsdp:DataParallelMeshDims"


def skip_unless_torchtitan_qwen3_5() -> None:
    """Skip (at module level too) without torchtitan, or when the installed torch cannot import torchtitan 0.3's
    Qwen3.5 model; the reason names the torch version and what it lacks
    (:data:`fla_ac_isolation.environment.TORCH_FEATURES`)."""
    from fla_ac_isolation.environment import torch_features

    pytest.importorskip("torchtitan")
    (feature,) = [f for f in torch_features() if f.needs == TITAN_QWEN3_5_NEEDS]
    if not feature.available:
        pytest.skip(feature.reason(), allow_module_level=True)


def torchtitan_qwen3_5():
    """The torchtitan example module (``examples/torchtitan_qwen3_5.py``): ``build_model``, ``apply_ac``, ...

    Loaded by path (examples are not a package); torchtitan's process-wide set-up is done here.
    """
    from fla_ac_isolation.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

    ensure_torch_compat()
    setup_torchtitan("cpu")
    return load_script(ROOT / "examples" / "torchtitan_qwen3_5.py", "torchtitan_qwen3_5_example")


def torchtitan_gdn_forward_without_clone():
    """torchtitan 0.3's ``GatedDeltaNet.forward`` minus its per-call ``cu_seq_q.clone()`` (model.py:410).

    Built from torchtitan's own source with that one expression replaced (asserted present exactly once),
    so the mixer hands FLA the model-level ``cu_seq_q`` object, as transformers' and OLMo-core's models do.
    """
    import textwrap

    import torchtitan.models.qwen3_5.model as titan_model

    source = textwrap.dedent(inspect.getsource(titan_model.GatedDeltaNet.forward))
    clone = "attention_masks.cu_seq_q.clone()"
    assert source.count(clone) == 1, "torchtitan's GatedDeltaNet.forward changed: no single cu_seq_q.clone()"
    namespace = dict(vars(titan_model))
    exec(compile(source.replace(clone, "attention_masks.cu_seq_q"), titan_model.__file__, "exec"), namespace)
    return namespace["forward"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (GPU parity tests)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()

"""swap_mixers on flash-linear-attention 0.6's ``fla.layers.Mamba2``: FLA's Mamba2ForCausalLM made packed-correct.

FLA's ``Mamba2`` takes ``**kwargs`` and never reads ``cu_seqlens``, so its causal LM, which hands one
``cu_seqlens`` to every block, mixes packed documents. ``swap_mixers(model)`` puts
:class:`~fla_ac_isolation.mixers.FlaMamba2` in its place on the same tensors.

On a CPU FLA's layer runs its torch path (``torch_forward``) except two Triton pieces, which the tests replace on
the instance with FLA's own torch equivalents (:func:`_fla_torch_path`): its activation ``ACT2FN['silu']`` (FLA's
Triton swish) by ``F.silu``, and ``RMSNormGated.forward`` by FLA's ``rms_norm_ref``. The model's ``RMSNorm``s run
on ``reference_kernels``. Model: 4 blocks, hidden 64, 8 heads of 16, state 16, 2 groups, FLA chunk 16; 3 packed
documents of 70 + 23 + 41 tokens.
"""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit, restore_mixers, swap_mixers
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.harness.reference_kernels import reference_kernels
from fla_ac_isolation.isolate import LeakingMixerWarning, isolate_seqlens
from fla_ac_isolation.mixers import FlaMamba2
from fla_ac_isolation.policies import any_of, sac_context_fn, save_all_copies, save_ops

pytest.importorskip("fla.models")
pytestmark = pytest.mark.usefixtures("single_thread")

LENS = (70, 23, 41)
CU = torch.tensor([0, *itertools.accumulate(LENS)], dtype=torch.int32)
PATHS = [f"backbone.layers.{i}.mixer" for i in range(4)]
EPS32 = torch.finfo(torch.float32).eps
# Both FLA's torch path and the drop-in compute the scan and the norm in float32 (``.float()``), whatever the
# input dtype; they round at different points (FLA's chunk 16, ours 64), so agreement is float32 rounding: 32 ulps
# of the output's magnitude (measured 2.9e-7 at magnitude 1.9, about 1.3 ulps).
ULPS = 32


def _config(**overrides):
    from fla.models import Mamba2Config

    fields = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, head_dim=16, state_size=16, n_groups=2,
                  expand=2, chunk_size=16, fuse_cross_entropy=False, fuse_linear_cross_entropy=False, fuse_norm=False,
                  use_cache=False)
    return Mamba2Config(**{**fields, **overrides})


def _fla_torch_path(model: nn.Module) -> nn.Module:
    """FLA's layers on their torch path: FLA's Triton swish and gated norm replaced by FLA's torch equivalents."""
    from fla.layers.mamba2 import Mamba2
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    for module in model.modules():
        if isinstance(module, Mamba2):
            module.act = F.silu
            norm = module.norm
            if norm is None:  # rmsnorm=False: y * act(gate)
                continue
            norm.forward = lambda x, z=None, n=norm: rms_norm_ref(x, n.weight, n.bias, z, n.eps, n.group_size,
                                                                  n.norm_before_gate)
    return model


def _model(seed: int = 0, **overrides) -> nn.Module:
    from fla.models import Mamba2ForCausalLM

    torch.manual_seed(seed)
    return _fla_torch_path(Mamba2ForCausalLM(_config(**overrides)).train())


def _ids() -> torch.Tensor:
    return torch.randint(1, 128, (1, sum(LENS)), generator=torch.Generator().manual_seed(0))


def _packed_vs_alone(model: nn.Module, **offsets) -> list[float]:
    """Per document: max |logits packed - logits of the document alone|."""
    ids = _ids()
    offsets = offsets or {"cu_seqlens": CU}
    with reference_kernels(), torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **offsets).logits
        bounds = list(zip(CU[:-1].tolist(), CU[1:].tolist()))
        return [(packed[:, a:b] - model(input_ids=ids[:, a:b], use_cache=False).logits).abs().max().item()
                for a, b in bounds]


@pytest.fixture(scope="module")
def shipped():
    return _model()


@pytest.fixture(scope="module")
def swapped(shipped):
    model = copy.deepcopy(shipped)
    assert swap_mixers(model) == PATHS
    return model


# ------------------------------------------------------------------------------------- packed documents
def test_shipped_mamba2_mixes_packed_documents(shipped):
    diffs = _packed_vs_alone(shipped)
    assert diffs[0] <= ULPS * EPS32  # the first document sees no other: rounding only (measured 1.5e-7)
    assert min(diffs[1:]) > 0.3, diffs  # measured 0.42, 0.43: state flows across the boundary


def test_swapped_model_keeps_packed_documents_apart(swapped):
    diffs = _packed_vs_alone(swapped)
    # fp32 logits; the bound is fp32 rounding of logits of magnitude ~1 (32 ulps); measured 0.0: the reference
    # backend scans each document on its own, as the document alone is scanned
    assert max(diffs) <= ULPS * EPS32, diffs
    assert max(_packed_vs_alone(swapped, seqlens=LayerLocalSeqlens(CU))) <= ULPS * EPS32  # seqlens= as well


def test_the_mutation_ignoring_cu_seqlens_fails_the_packed_check(swapped, monkeypatch):
    """Mutation: the drop-in forgets ``cu_seqlens`` (as FLA's layer does): the packed check sees the leak."""
    forward = FlaMamba2.forward

    def ignores_offsets(self, hidden_states, *args, cu_seqlens=None, **kwargs):
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(FlaMamba2, "forward", ignores_offsets)
    diffs = _packed_vs_alone(swapped)
    assert diffs[0] <= ULPS * EPS32 and min(diffs[1:]) > 0.3, diffs


# ------------------------------------------------------------------------------------- numerics vs FLA
def _naive(layer: nn.Module, x: torch.Tensor, group_of) -> torch.Tensor:
    """An independent float64 token recurrence of a Mamba2 layer ``[1, T, D]`` on ``layer``'s tensors, with
    head ``h`` reading ``B``/``C`` of group ``group_of(h)``."""
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    heads, dim, groups, state, inter = layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size, \
        layer.intermediate_size
    tokens = x.shape[1]
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    gate, xbc, dt = F.linear(x, w["in_proj.weight"]).split([inter, layer.conv_dim, heads], -1)
    xbc = F.conv1d(xbc.transpose(1, 2), w["conv1d.weight"], w["conv1d.bias"], padding=layer.conv_kernel_size - 1,
                   groups=layer.conv_dim)[..., :tokens].transpose(1, 2)
    xs, B, C = F.silu(xbc)[0].split([inter, groups * state, groups * state], -1)
    xs, B, C = xs.view(tokens, heads, dim), B.view(tokens, groups, state), C.view(tokens, groups, state)
    dt = F.softplus(dt[0] + w["dt_bias"]).clamp(*layer.dt_limit)
    A = -torch.exp(w["A_log"])
    index = torch.tensor([group_of(h) for h in range(heads)])
    h_state, ys = torch.zeros(heads, dim, state, dtype=torch.float64), []
    for t in range(tokens):
        h_state = h_state * torch.exp(dt[t] * A)[:, None, None] + \
            (dt[t, :, None, None] * xs[t, :, :, None] * B[t, index][:, None, :])
        ys.append(torch.einsum("hpn,hn->hp", h_state, C[t, index]) + w["D"][:, None] * xs[t])
    y = torch.stack(ys).reshape(1, tokens, inter)
    if not layer.rmsnorm:  # FLA's rmsnorm=False: the gate alone
        return F.linear(y * F.silu(gate), w["out_proj.weight"])
    y = rms_norm_ref(y, w["norm.weight"], None, gate, layer.norm.eps, layer.norm.group_size,
                     layer.norm.norm_before_gate, upcast=False)
    return F.linear(y, w["out_proj.weight"])


def _layer(n_groups: int, rmsnorm: bool = True):
    from fla.layers.mamba2 import Mamba2

    torch.manual_seed(1)
    layer = Mamba2(num_heads=8, head_dim=16, hidden_size=64, state_size=16, n_groups=n_groups, chunk_size=16,
                   layer_idx=0, backend="triton", rmsnorm=rmsnorm)
    with torch.no_grad():  # constants after init: perturb so every term matters
        if rmsnorm:
            layer.norm.weight.add_(0.3 * torch.randn_like(layer.norm.weight))
        layer.D.add_(0.2 * torch.randn_like(layer.D))
    holder = nn.ModuleDict({"mixer": copy.deepcopy(layer)})
    assert swap_mixers(holder) == ["mixer"]
    return _fla_torch_path(nn.ModuleDict({"mixer": layer}))["mixer"], holder["mixer"]


@pytest.mark.parametrize("n_groups", [1, 2])
def test_drop_in_is_mamba2_and_matches_flas_torch_path_where_that_path_is_mamba2(n_groups):
    """Against an independent float64 recurrence: the drop-in maps head ``h`` to group ``h // (H / G)`` (mamba_ssm's
    kernel, FLA's CUDA path and FLA's own decode step); FLA 0.6's torch prefill tiles ``B``/``C`` with ``.repeat``,
    head ``h`` to group ``h % G``. With one group both agree, and the drop-in equals FLA's torch path."""
    fla_layer, ours = _layer(n_groups)
    x = torch.randn(1, 40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    per_group = 8 // n_groups
    kernel = _naive(fla_layer, x, lambda h: h // per_group)
    tiled = _naive(fla_layer, x, lambda h: h % n_groups)
    with torch.no_grad():
        theirs, mine = fla_layer.double()(x)[0], ours.double()(x)[0]
    bound = ULPS * EPS32 * kernel.abs().max().item()
    assert (mine - kernel).abs().max().item() <= bound
    assert (theirs - tiled).abs().max().item() <= bound
    gap = (mine - theirs).abs().max().item()
    if n_groups == 1:
        assert gap <= bound  # measured 2.9e-7 (float32 inside both)
    else:
        assert gap > 0.02  # measured 0.049: far above the bound (the two recurrences above say why)


def test_a_layer_without_rmsnorm_swaps_and_is_mamba2_with_the_gate_alone():
    """FLA's ``rmsnorm=False``: no norm parameters, the output ``y * silu(gate)``. The drop-in takes it (its
    ``state_dict`` has FLA's names, no ``norm.weight``) and matches the independent float64 recurrence, and FLA's
    torch path with one group."""
    fla_layer, ours = _layer(1, rmsnorm=False)
    assert fla_layer.norm is None and not ours.rmsnorm and "rmsnorm=False" in repr(ours)
    assert list(ours.state_dict()) == list(fla_layer.state_dict())
    assert not any(name.startswith("norm.") for name in ours.state_dict())
    x = torch.randn(1, 40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = _naive(fla_layer, x, lambda h: 0)
    with torch.no_grad():
        theirs, mine = fla_layer.double()(x)[0], ours.double()(x)[0]
    bound = ULPS * EPS32 * expected.abs().max().item()
    assert (mine - expected).abs().max().item() <= bound
    assert (theirs - expected).abs().max().item() <= bound


def test_unpacked_model_logits_match_flas_torch_path_with_one_group():
    model = _model(n_groups=1)
    ours = copy.deepcopy(model)
    swap_mixers(ours)
    with reference_kernels(), torch.no_grad():
        theirs = model(input_ids=_ids(), use_cache=False).logits
        mine = ours(input_ids=_ids(), use_cache=False).logits
    assert (mine - theirs).abs().max().item() <= ULPS * EPS32 * theirs.abs().max().item()  # measured 1.8e-6 / 0.62


# ------------------------------------------------------------------------------------- checkpoints
def test_state_dicts_load_both_ways_with_the_same_names_order_and_shapes(shipped, swapped):
    from fla.models import Mamba2ForCausalLM

    assert list(swapped.state_dict()) == list(shipped.state_dict())
    assert {n: p.shape for n, p in swapped.named_parameters()} == {n: p.shape for n, p in shipped.named_parameters()}
    fresh_fla = _fla_torch_path(Mamba2ForCausalLM(_config()))
    fresh_ours = copy.deepcopy(fresh_fla)
    swap_mixers(fresh_ours)
    fresh_fla.load_state_dict(swapped.state_dict(), strict=True)  # ours -> FLA
    fresh_ours.load_state_dict(shipped.state_dict(), strict=True)  # FLA -> ours
    assert all(torch.equal(p, shipped.get_parameter(n)) for n, p in fresh_fla.named_parameters())
    assert all(torch.equal(p, shipped.get_parameter(n)) for n, p in fresh_ours.named_parameters())
    layer = shipped.backbone.layers[0].mixer
    mixer = FlaMamba2(hidden_size=64, head_dim=16, state_size=16, n_groups=2, expand=2, chunk_size=16)  # directly
    mixer.load_state_dict(layer.state_dict(), strict=True)
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(mixer(x)[0], swapped.backbone.layers[0].mixer(x)[0])


def test_swap_shares_the_tensors_and_restore_puts_flas_layer_back(shipped):
    model = copy.deepcopy(shipped)
    params = dict(model.named_parameters())
    assert swap_mixers(model) == PATHS
    assert all(p is params[n] for n, p in model.named_parameters())
    assert restore_mixers(model) == PATHS
    assert type(model.backbone.layers[0].mixer).__module__ == "fla.layers.mamba2"
    assert all(p is params[n] for n, p in model.named_parameters())


# ------------------------------------------------------------------------------------- under SAC
#: every ``_to_copy`` and every ``mm`` saved: the field's D2H-copy rule widened to all copies, plus matmuls
POLICY = any_of(save_all_copies(), save_ops([torch.ops.aten.mm.default]))


def _step(model: nn.Module, checkpointed: bool, **offsets):
    model = copy.deepcopy(model).to(torch.bfloat16)
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": sac_context_fn(POLICY)})
    ids = _ids()
    labels = ids.clone()
    labels[0, CU[:-1].long()] = -100
    with reference_kernels(), ReplayAudit(model, on_divergence="record") as audit:
        loss = model(input_ids=ids, labels=labels, use_cache=False, **offsets).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, audit


def test_swapped_model_under_sac_with_one_shared_cu_seqlens_is_bit_exact(swapped):
    """bf16, FLA's model handing its one ``cu_seqlens`` object to every block; each block checkpointed."""
    loss_ref, grads_ref, _ = _step(swapped, False, cu_seqlens=CU)
    loss, grads, audit = _step(swapped, True, cu_seqlens=CU)
    assert audit.ok and len(audit.regions) == 4, audit.summary()
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    assert all(torch.equal(grads[n], g) for n, g in grads_ref.items())


def test_the_drop_in_handed_shared_offsets_fails_under_the_same_policy(swapped):
    """Control: the same model and policy with ``modes.SharedSeqlens`` (``.local()`` hands every layer the same
    objects, the unsafe path): layer 0's recompute hits FLA's cache where its forward missed, skips the int32 ->
    int64 ``_to_copy``, and a later saved bf16 -> fp32 cast is replayed with FLA's int tensor."""
    with pytest.raises(RuntimeError, match=re.escape("Autograd not support dtype: Int")):
        _step(swapped, True, seqlens=SharedSeqlens(CU))


# ------------------------------------------------------------------------------------- the registry's views
def test_isolate_seqlens_check_and_doctor_name_the_drop_in(shipped, swapped):
    from fla_ac_isolation.harness.check import survey
    from fla_ac_isolation.harness.environment import fla_backed_classes

    fix = "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.FlaMamba2)"
    why = "takes **kwargs but its forward never reads cu_seqlens (no varlen path)"
    with pytest.warns(LeakingMixerWarning, match=re.escape(
            f"isolate_seqlens: Mamba2 (flash-linear-attention; 4 in the model: {', '.join(PATHS[:3])}, ...) {why}: "
            f"documents are not kept apart: {fix}")), \
            pytest.raises(ValueError, match="found no FLA-backed mixer in Mamba2ForCausalLM"):
        isolate_seqlens(copy.deepcopy(shipped))
    (found,) = survey(shipped)
    assert (found.cls, found.status, found.paths, found.why, found.fix) == (
        "fla.layers.mamba2.Mamba2", "leaking", tuple(PATHS), why, fix)
    (ours,) = survey(swapped)
    assert (ours.cls, ours.status, ours.paths) == ("fla_ac_isolation.mixers.FlaMamba2", "covered",
                                                   tuple(PATHS))
    (listed,) = [s for s in fla_backed_classes() if s.name == "Mamba2"]
    assert listed.status == f"leaking (documents are not kept apart): {fix}"


def test_cached_decoding_is_flas_own_layer_and_uncached_is_ours():
    """With a cache the drop-in runs FLA's own forward (same tokens as the shipped model); without one, ours, which
    equals FLA's uncached forward. FLA's own Mamba2 gives other tokens cached than uncached (its decoding differs
    from its full forward here), and the drop-in keeps both behaviours."""
    model = _model().eval()
    ours = copy.deepcopy(model)
    swap_mixers(ours)
    ids = _ids()[:, :12]
    with reference_kernels(), torch.no_grad():
        tokens = {(name, cache): m.generate(ids, max_new_tokens=5, do_sample=False, use_cache=cache)[0, 12:].tolist()
                  for name, m in (("shipped", model), ("swapped", ours)) for cache in (True, False)}
    assert tokens["swapped", True] == tokens["shipped", True]
    assert tokens["swapped", False] == tokens["shipped", False]
    assert tokens["shipped", True] != tokens["shipped", False]  # FLA's own: measured [30, 84, ...] vs [30, 20, ...]

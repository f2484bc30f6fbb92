"""isolate_seqlens: what the hook hands each call, which modules it finds, its errors, warnings and handle.

Small modules only (a recorder module and transformers' own Qwen3.5-MoE mixers, which need no kernel call
here); the end-to-end proofs on OLMo-core, transformers and torchtitan models under AC are in
``test_isolate_olmo_core.py``, ``test_isolate_transformers.py`` and ``test_isolate_torchtitan.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from helpers import MODEL_FAMILIES
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fla_ac_isolation import isolate_seqlens, swap_mixers
from fla_ac_isolation.fla_seam.features import supports
from fla_ac_isolation.fla_seam.layout import chunk_indices_for
from fla_ac_isolation.harness.reference_kernels import reference_kernels
from fla_ac_isolation.isolate import PartialIsolationWarning

GDN_PATHS = [f"model.layers.{i}.linear_attn" for i in range(3)]


class Recorder(nn.Module):
    """Records the objects it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x, cu_seqlens=None, meta=None):
        self.seen.append((cu_seqlens, meta))
        return x


class Metadata(NamedTuple):  # the shape of torchtitan's VarlenMetadata
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    host: tuple


def _holder(module: nn.Module) -> nn.Module:
    return nn.ModuleDict({"mixer": module})


def _offsets() -> torch.Tensor:
    return torch.tensor([0, 5, 5, 22], dtype=torch.int32)


@pytest.fixture(scope="module")
def qwen():
    """transformers' Qwen3.5-MoE, tiny: 3 GDN mixers + 1 attention layer (built once; tests deep-copy it)."""
    return MODEL_FAMILIES["qwen3_5_moe"].model()


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


# ------------------------------------------------------------------------------------ what a call gets
def test_named_offsets_arrive_as_a_new_equal_tensor_on_every_call_keyword_or_positional():
    model = _holder(Recorder())
    handle = isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    cu = _offsets()
    x = torch.zeros(1, 22, 4)
    model["mixer"](x, cu_seqlens=cu)
    model["mixer"](x, cu)
    model["mixer"](x, cu_seqlens=cu)

    got = [seen for seen, _ in model["mixer"].seen]
    assert handle.paths == ["mixer"]
    assert all(t is not cu and torch.equal(t, cu) and t.dtype == cu.dtype for t in got)
    assert len({id(t) for t in got}) == 3  # a new object per call (the forward and its recompute differ)


def test_copies_are_invisible_to_dispatch_modes():
    """SAC and the audit are dispatch modes: a copy they saw could be saved and handed back (same object)."""

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = _holder(Recorder())
    isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    cu, x = _offsets(), torch.zeros(1, 22, 4)
    with Ops() as mode:
        model["mixer"](x, cu_seqlens=cu)
    assert mode.ops == []
    assert model["mixer"].seen[0][0] is not cu


def test_namedtuple_offsets_are_replaced_fresh_keeping_aliasing_and_other_fields():
    model = _holder(Recorder())
    isolate_seqlens(model, modules=["mixer"], arg_names=["meta"])
    cu = _offsets()
    meta = Metadata(cu, cu, 17, (0, 5, 5, 22))
    model["mixer"](torch.zeros(1, 22, 4), meta=meta)

    got = model["mixer"].seen[0][1]
    assert type(got) is Metadata and got.max_q == 17 and got.host == (0, 5, 5, 22)
    assert got.cu_seq_q is not cu and torch.equal(got.cu_seq_q, cu)
    assert got.cu_seq_k is got.cu_seq_q  # one object in, one fresh object out
    assert meta.cu_seq_q is cu  # the caller's tuple is left as it was


def test_dynamic_shape_marking_is_kept_on_the_copy():
    """OLMo-core marks cu_doc_lens dynamic for torch.compile; a copy without the mark recompiles per length."""
    model = _holder(Recorder())
    isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    cu = _offsets()
    torch._dynamo.mark_dynamic(cu, 0)
    model["mixer"](torch.zeros(1, 22, 4), cu_seqlens=cu)
    assert model["mixer"].seen[0][0]._dynamo_dynamic_indices == {0}


def test_a_named_argument_that_holds_no_offsets_raises_at_the_call_naming_it():
    model = _holder(Recorder())
    isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    with pytest.raises(TypeError, match=r"argument 'cu_seqlens' of mixer is a torch.float32 tensor of shape \(4,\)"):
        model["mixer"](torch.zeros(1, 22, 4), cu_seqlens=torch.zeros(4))
    model["mixer"](torch.zeros(1, 22, 4))  # absent (None): an unpacked batch, nothing to do
    assert model["mixer"].seen[-1] == (None, None)


def test_transformers_mixer_hands_fla_fresh_offsets_host_offsets_and_the_chunk_schedule(qwen):
    model = _copy(qwen)
    isolate_seqlens(model)
    mixer = model.get_submodule(GDN_PATHS[0])
    cu = torch.tensor([0, 70, 93, 134], dtype=torch.int32)
    with reference_kernels() as served:  # FLA's kernel call, served on CPU, records what it receives
        for _ in range(2):
            mixer(torch.randn(1, 134, 64), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=70)

    calls = [c for c in served.calls if c.kernel == "chunk_gated_delta_rule"]  # through transformers' wrapper
    assert len(calls) == 2
    # transformers hands FLA's GDN only the keywords of the function it bound at import: fla-core 0.6's names
    # chunk_indices; 0.5.2's does not (FLA then builds the schedule from the fresh cu_seqlens), unless the model
    # module was imported while reference_kernels() served it (the stand-in names it): all calls alike either way
    takes_schedule = calls[0].chunk_indices is not None
    assert takes_schedule or not supports("gdn_chunk_indices")
    for call in calls:
        assert call.cu_seqlens is not cu and torch.equal(call.cu_seqlens, cu)
        assert call.cu_seqlens_cpu.device.type == "cpu" and call.cu_seqlens_cpu.tolist() == [0, 70, 93, 134]
        if takes_schedule:
            assert torch.equal(call.chunk_indices, chunk_indices_for([0, 70, 93, 134]).to(torch.int32))
        else:
            assert call.chunk_indices is None
    assert calls[0].cu_seqlens is not calls[1].cu_seqlens
    assert not takes_schedule or calls[0].chunk_indices is not calls[1].chunk_indices


def test_transformers_offsets_that_are_not_offsets_raise_at_the_call(qwen):
    model = _copy(qwen)
    isolate_seqlens(model)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q passed to model.layers.0.linear_attn is not valid offsets: "
                                         r"cu_seqlens must start at 0, got 3"):
        model.get_submodule(GDN_PATHS[0])(torch.randn(1, 22, 64),
                                          cu_seq_lens_q=torch.tensor([3, 5, 22], dtype=torch.int32))


# ------------------------------------------------------------------------------------------ never silent
class KwargsRecorder(nn.Module):
    """A mixer taking ``**kwargs``, as transformers' do: the name check at hook time cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x, **kwargs):
        self.seen.append(kwargs)
        return x


def test_a_hook_whose_names_never_arrive_raises_at_the_call_naming_what_arrived_but_unpacked_calls_pass():
    model = _holder(KwargsRecorder())
    handle = isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    x, cu = torch.zeros(1, 22, 4), _offsets()
    model["mixer"](x, position_ids=torch.arange(22)[None])  # unpacked: nothing offsets-like, nothing to do
    model["mixer"](x, cu_seqlens=cu)
    with pytest.raises(ValueError) as err:
        model["mixer"](x, cu_doc_lens=cu, max_doc_len=17)

    assert str(err.value) == (
        "isolate_seqlens: mixer (KwargsRecorder) is hooked to refresh ['cu_seqlens'], but this call passed none of "
        "them and passed the offsets-like keyword(s) ['cu_doc_lens']: the shared offsets would reach FLA unchanged "
        "(the fault stays); if KwargsRecorder.forward hands ['cu_doc_lens'] to FLA, hook it with "
        "arg_names=['cu_doc_lens']; if it is a misspelling of ['cu_seqlens'], fix the call"
    )
    assert len(model["mixer"].seen) == 2 and handle.rewritten == 1
    assert repr(handle) == "IsolationHandle(1 hooked, 1 calls rewritten: mixer)"


@pytest.fixture(scope="module")
def qwen3_next():
    """transformers' Qwen3-Next, tiny (3 GDN mixers + 1 attention layer), and its packed batch."""
    from fla_ac_isolation.harness.foreign_models import build_tiny

    model, batch, _ = build_tiny("qwen3_next")
    return model, batch


def test_the_faqs_old_recipe_on_qwen3_next_fails_at_the_first_call_instead_of_doing_nothing(qwen3_next):
    """transformers' mixers take **kwargs: ``arg_names=["cu_seqlens"]`` is accepted, and was a silent no-op (the
    fault stayed). It now raises at the first packed call, pointing at the names that work."""
    model, batch = _copy(qwen3_next[0]), qwen3_next[1]
    paths = [p for p, m in model.named_modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    handle = isolate_seqlens(model, modules=paths, arg_names=["cu_seqlens"])
    assert handle.paths == paths == GDN_PATHS
    with reference_kernels(), pytest.raises(ValueError) as err:
        model(**batch)

    assert str(err.value) == (
        "isolate_seqlens: model.layers.0.linear_attn (Qwen3NextGatedDeltaNet) is hooked to refresh ['cu_seqlens'], "
        "but this call passed none of them and passed the offsets-like keyword(s) ['cu_seq_lens_k', "
        "'cu_seq_lens_q']: the shared offsets would reach FLA unchanged (the fault stays); call "
        "isolate_seqlens(model) without arg_names: the registry knows Qwen3NextGatedDeltaNet and refreshes "
        "['cu_seq_lens_q', 'cu_seq_lens_k']"
    )
    with reference_kernels():  # an unpacked batch carries no offsets: it runs
        model(input_ids=batch["input_ids"], use_cache=False)
    assert handle.rewritten == 0


def test_the_right_recipe_on_qwen3_next_rewrites_every_call(qwen3_next):
    model, batch = _copy(qwen3_next[0]), qwen3_next[1]
    handle = isolate_seqlens(model)
    with reference_kernels() as served:
        model(**batch)

    calls = [c for c in served.calls if c.kernel == "chunk_gated_delta_rule"]
    assert handle.paths == GDN_PATHS and handle.rewritten == 3
    assert all(c.cu_seqlens is not batch["cu_seq_lens_q"] for c in calls) and len(calls) == 3
    # transformers hands FLA's GDN only the keywords of the function it bound at import: fla-core 0.6's names
    # chunk_indices; 0.5.2's does not (FLA then builds the schedule from the fresh cu_seqlens), unless the model
    # module was imported while reference_kernels() served it (the stand-in names it): all calls alike either way
    assert all(c.cu_seqlens_cpu is not None for c in calls)
    scheduled = {c.chunk_indices is not None for c in calls}
    assert scheduled == {True} if supports("gdn_chunk_indices") else len(scheduled) == 1


# ------------------------------------------------------------------------------------- which modules
def test_known_mixers_are_found_through_fsdp2s_renamed_classes(qwen):
    model = _copy(qwen)
    mixer = model.get_submodule(GDN_PATHS[1])
    cls = type(mixer)
    mixer.__class__ = type(f"FSDP{cls.__name__}", (cls,), {})  # what fully_shard does to a module's class

    handle = isolate_seqlens(model)

    assert handle.paths == GDN_PATHS


def test_a_subclass_that_overrides_forward_is_hooked_with_a_warning(qwen):
    model = _copy(qwen)
    mixer = model.get_submodule(GDN_PATHS[0])
    mixer.__class__ = type("MyGatedDeltaNet", (type(mixer),), {"forward": lambda self, *a, **k: None})
    with pytest.warns(UserWarning, match=r"'model.layers.0.linear_attn' \(MyGatedDeltaNet\) subclasses "
                                         r"transformers.*Qwen3_5MoeGatedDeltaNet and overrides forward"):
        assert isolate_seqlens(model).paths == GDN_PATHS


def test_second_call_hooks_nothing_and_warns_then_remove_and_reisolate(qwen):
    model = _copy(qwen)
    first = isolate_seqlens(model)
    with pytest.warns(UserWarning, match=r"nothing new to isolate; the 3 FLA-backed mixer\(s\)"):
        second = isolate_seqlens(model)
    assert second.paths == []
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 3

    first.remove()
    first.remove()  # idempotent
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert isolate_seqlens(model).paths == GDN_PATHS


def test_handle_as_context_manager_removes_its_hooks():
    model = _holder(Recorder())
    cu = _offsets()
    with isolate_seqlens(model, modules=[model["mixer"]], arg_names=["cu_seqlens"]):
        model["mixer"](torch.zeros(1, 22, 4), cu_seqlens=cu)
    model["mixer"](torch.zeros(1, 22, 4), cu_seqlens=cu)
    assert model["mixer"].seen[0][0] is not cu and model["mixer"].seen[1][0] is cu


def test_modules_that_leave_known_mixers_unhooked_warn_naming_them(qwen):
    model = _copy(qwen)
    with pytest.warns(PartialIsolationWarning, match=r"left 2 FLA-backed mixer\(s\) of the model unhooked "
                                                     r"\(model.layers.1.linear_attn, model.layers.2.linear_attn\)"):
        handle = isolate_seqlens(model, modules=[GDN_PATHS[0]])
    assert handle.paths == [GDN_PATHS[0]]


# ---------------------------------------------------------------------------------------------- errors
def test_a_model_without_fla_backed_mixers_is_refused_listing_what_was_looked_for():
    with pytest.raises(ValueError) as err:
        isolate_seqlens(nn.Sequential(nn.Linear(4, 4)))
    message = str(err.value)
    assert message.startswith("isolate_seqlens found no FLA-backed mixer in Sequential; looked for ")
    for looked in ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet(cu_seq_lens_q, "
                   "cu_seq_lens_k)", "Qwen3_5GatedDeltaNet", "Qwen4ExpTextGatedDeltaNet", "Qwen3NextGatedDeltaNet",
                   "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet",
                   "flash-linear-attention's layers (fla.layers., fla.models.) reading cu_seqlens",
                   "torchtitan.models.qwen3_5.model.GatedDeltaNet(attention_masks)",
                   "olmo_core.nn.attention.recurrent.GatedDeltaNet(cu_doc_lens)",
                   "olmo_core.nn.attention.kda.KimiDeltaAttention(cu_doc_lens)"):
        assert looked in message
    assert message.endswith("pass modules=[...] and arg_names=[...] for other FLA-backed modules")


def test_a_model_of_our_own_mixers_is_refused_saying_they_isolate_themselves(qwen):
    model = _copy(qwen)
    swap_mixers(model)
    with pytest.raises(ValueError, match=r"its 3 fla_ac_isolation mixer\(s\) \('model.layers.0.linear_attn', "
                                         r"\.\.\.\) take fresh offsets themselves"):
        isolate_seqlens(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": {}}, TypeError, r"model must be a torch.nn.Module, got dict"),
        ({"arg_names": "cu_seqlens"}, TypeError, r"arg_names must be a list of argument names \(str\), got 'cu_seqlens'"),
        ({"arg_names": []}, ValueError, r"arg_names must name at least one argument"),
        ({"modules": "mixer"}, TypeError, r"modules must be a list of modules or module paths, got str"),
        ({"modules": []}, ValueError, r"modules must name at least one module"),
        ({"modules": ["mixr"]}, ValueError, r"modules\[0\] = 'mixr' is not a submodule path of the model"),
        ({"modules": [nn.Linear(2, 2)]}, ValueError, r"modules\[0\] \(Linear\) is not a submodule of the model"),
        ({"modules": [3]}, TypeError, r"modules\[0\] must be an nn.Module or a module path \(str\), got int"),
        ({"modules": ["mixer"], "arg_names": None}, ValueError,
         r"'mixer' \(Recorder\) is not a known FLA-backed mixer; pass arg_names=\[...\]"),
        ({"arg_names": ["cu_seqlen"]}, ValueError,
         r"arg_names \['cu_seqlen'\] are not arguments of the forward of 'mixer' \(Recorder\), which takes "
         r"\['x', 'cu_seqlens', 'meta'\]"),
    ],
    ids=["model", "arg_names-str", "arg_names-empty", "modules-str", "modules-empty", "path", "foreign-module",
         "entry-type", "unknown-without-arg_names", "arg_names-not-in-forward"],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs, error, message):
    model = _holder(Recorder())
    call = {"modules": ["mixer"], "arg_names": ["cu_seqlens"], **kwargs}
    with pytest.raises(error, match=message):
        isolate_seqlens(call.pop("model", model), **call)
    assert not model["mixer"]._forward_pre_hooks  # nothing was hooked


def test_arg_names_are_not_checked_against_a_forward_taking_kwargs(qwen):
    model = _copy(qwen)  # transformers' GDN forward takes **kwargs: any name may reach it
    assert isolate_seqlens(model, arg_names=["cu_seq_lens_q", "my_offsets"]).paths == GDN_PATHS
    with pytest.raises(ValueError, match=r"arg_names \['cu_seqlen'\] are not arguments of the forward of 'mixer'"):
        isolate_seqlens(_holder(Recorder()), modules=["mixer"], arg_names=["cu_seqlens", "cu_seqlen"])


def test_a_known_fla_layer_called_with_a_misspelt_keyword_is_told_the_keyword_fla_reads():
    """flash-linear-attention's GatedDeltaNet reads ``cu_seqlens`` only: a call with ``cu_seq_lens=`` would run the
    packed batch as one sequence (the keyword never reaches FLA), so the advice is to fix the call, never to hook
    the misspelt name (``arg_names=['cu_seq_lens']`` would refresh a keyword FLA ignores, and documents mix)."""
    from fla.layers import GatedDeltaNet

    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    torch.manual_seed(0)
    model = _holder(GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, expand_v=1, mode="chunk"))
    handle = isolate_seqlens(model)
    x, cu = torch.randn(1, 22, 32), _offsets()
    with reference_kernels(), pytest.raises(ValueError) as err:
        model["mixer"](x, cu_seq_lens=cu)
    assert str(err.value) == (
        "isolate_seqlens: mixer (GatedDeltaNet) is hooked to refresh ['cu_seqlens'], but this call passed none of "
        "them and passed the offsets-like keyword(s) ['cu_seq_lens']: GatedDeltaNet hands FLA its offsets only from "
        "['cu_seqlens'], so FLA would never see these and would run the packed documents as one sequence (they "
        "mix); fix the call: pass the offsets as cu_seqlens=..."
    )
    with reference_kernels(), torch.no_grad():
        packed = model["mixer"](x, cu_seqlens=cu)[0]  # the advice followed: documents kept apart
        one_sequence = model["mixer"](x)[0]
        handle.remove()
        isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seq_lens"])  # the old advice, followed
        misspelt = model["mixer"](x, cu_seq_lens=cu)[0]
    assert torch.equal(misspelt, one_sequence)  # FLA never read cu_seq_lens: document 3 sees documents 1 and 2
    assert (packed[0, 5:] - one_sequence[0, 5:]).abs().max() > 1e-3

"""Foreign models for the isolate_seqlens and OLMo-core tests: OLMo-core's own hybrid Transformer (its batch, its
AC, one step), torchtitan's Qwen3.5 (whether this torch can import it, its example module, its GDN without the
per-call clone), and the audit's divergent regions.

OLMo-core and torchtitan are imported inside the functions: the GPU image may lack them (importorskip)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import warnings

import pytest
import torch
from torch import nn

from helpers.hf_models import DOC_LENS, VOCAB, Step, aten
from helpers.scripts import ROOT, load_script

INT_REPLAY = "Autograd not support dtype: Int"  # what SAC's misreplay of FLA's int tensors raises (torch 2.13)
OLMO_PATTERN = ("gdn", "attn")  # one GDN block is enough for the fault (FLA's cache holds 4 entries)
OLMO_AC_MODES = ("full", "selected_blocks", "selected_modules", "selected_ops")


def olmo_hybrid(pattern: tuple[str, ...] = OLMO_PATTERN, seed: int = 0, device: str = "cpu") -> nn.Module:
    """OLMo-core's own ``Transformer`` from ``TransformerConfig.qwen3_5_like`` (its hybrid recipe), tiny, fp32.

    Blocks follow ``pattern``: ``"gdn"`` (``GatedDeltaNet``), ``"attn"`` (full attention, torch backend),
    ``"kda"`` (``KimiDeltaAttention``) or ``"mamba"`` (``NemotronMamba2Mixer``, fp32). Norm weights are
    perturbed so gradients are generic. The torch backend needs
    :func:`~fla_ac_isolation.harness.testing.olmo_core.packed_attention_on_torch_backend` for packed documents.
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
    from fla_ac_isolation.fla_seam.cache import clear_tensor_cache

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
    (:data:`fla_ac_isolation.harness.environment.TORCH_FEATURES`)."""
    from fla_ac_isolation.harness.environment import torch_features

    pytest.importorskip("torchtitan")
    (feature,) = [f for f in torch_features() if f.needs == TITAN_QWEN3_5_NEEDS]
    if not feature.available:
        pytest.skip(feature.reason(), allow_module_level=True)


def torchtitan_qwen3_5():
    """The torchtitan example module (``examples/torchtitan_qwen3_5.py``): ``build_model``, ``apply_ac``, ...

    Loaded by path (examples are not a package); torchtitan's process-wide set-up is done here.
    """
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan

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

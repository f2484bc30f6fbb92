"""The FLA rule judges a class by the ``fla.layers`` / ``fla.models`` class of its hierarchy, not by its own module.

FSDP2's ``fully_shard`` swaps a module's class for a dynamic ``FSDP<Name>`` defined in torch's module
(``torch.distributed.fsdp._fully_shard._fsdp_init``), subclassing the original; a user's subclass lives in the
user's module. Both run FLA's forward, so both must be found (hooked when FLA's class reads ``cu_seqlens``,
named as leaking when it drops them). Real ``fully_shard`` on one gloo rank on a CPU (``gloo_world_of_one``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import fla_layer
from torch import nn

from fla_ac_isolation import isolate_seqlens
from fla_ac_isolation.foreign_classes import LeakingMixer, UpstreamMixer, fla_layer_mixer, foreign_mixer
from fla_ac_isolation.harness.foreign_models import build_tiny
from fla_ac_isolation.isolate import LeakingMixerWarning

pytestmark = pytest.mark.usefixtures("single_thread")

FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_init"
GDN = UpstreamMixer("fla.layers.gated_deltanet", "GatedDeltaNet", None, ("cu_seqlens",))


class StopForwardError(Exception):
    pass


def _offsets_seen(module: nn.Module, hidden: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    """The ``cu_seqlens`` two calls of ``module`` receive after every pre-hook already there (a spy registered last
    stops each call before FLA's Triton kernels)."""
    def spy(_module, _args, kwargs):
        raise StopForwardError(kwargs.get("cu_seqlens"))

    handle = module.register_forward_pre_hook(spy, with_kwargs=True)
    seen = []
    for _ in range(2):
        with pytest.raises(StopForwardError) as stopped:
            module(hidden, cu_seqlens=cu)
        seen.append(stopped.value.args[0])
    handle.remove()
    return seen


def test_flas_layers_after_fully_shard_are_hooked_and_get_fresh_offsets(gloo_world_of_one):
    model, batch, _ = build_tiny("gated_deltanet")
    paths = [p for p, m in model.named_modules() if type(m).__name__ == "GatedDeltaNet"]
    for path in paths:
        torch.distributed.fsdp.fully_shard(model.get_submodule(path), mesh=gloo_world_of_one)
    sharded = model.get_submodule(paths[0])
    assert (type(sharded).__module__, type(sharded).__name__) == (FSDP_MODULE, "FSDPGatedDeltaNet")
    assert fla_layer_mixer(type(sharded)) == GDN  # judged by FLA's class in its hierarchy
    assert foreign_mixer(sharded) == (GDN, type(sharded).__mro__[2])  # (FSDPGatedDeltaNet, FSDPModule, GatedDeltaNet)

    cu = batch["cu_seqlens"]
    hidden = torch.randn(1, int(cu[-1]), model.config.hidden_size)
    shared = _offsets_seen(sharded, hidden, cu)
    assert all(t is cu for t in shared)  # not isolated: FLA's layer receives the model's one object

    handle = isolate_seqlens(model)
    seen = [t for path in paths for t in _offsets_seen(model.get_submodule(path), hidden, cu)]

    assert len(paths) == 4 and handle.paths == paths
    assert all(t is not cu and torch.equal(t, cu) for t in seen)
    assert len({id(t) for t in seen}) == 2 * len(paths) and handle.rewritten == 2 * len(paths)
    handle.remove()


class MyGatedDeltaNet(GDN.resolve()):
    """A user's subclass, in this module, keeping FLA's forward."""


def test_a_users_subclass_of_an_fla_layer_in_another_module_is_hooked():
    layer = MyGatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16, mode="chunk")
    assert type(layer).__module__ == __name__
    assert fla_layer_mixer(MyGatedDeltaNet) == GDN
    assert foreign_mixer(layer) == (GDN, GDN.resolve())

    model = nn.ModuleDict({"mixer": layer})
    handle = isolate_seqlens(model)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    seen = _offsets_seen(layer, torch.randn(1, 7, 64), cu)

    assert handle.paths == ["mixer"] and handle.rewritten == 2
    assert all(t is not cu and torch.equal(t, cu) for t in seen)


def test_a_subclass_of_an_fla_layer_that_drops_the_offsets_is_named_as_leaking():
    mamba2 = type(fla_layer("Mamba2"))
    layer = fla_layer("Mamba2")
    layer.__class__ = type("MyMamba2", (mamba2,), {"__module__": __name__})

    assert fla_layer_mixer(type(layer)) == LeakingMixer(
        "fla.layers.mamba2", "Mamba2", "takes **kwargs but its forward never reads cu_seqlens (no varlen path)",
        "train it on unpacked batches (one document per row), or use an FLA layer that reads cu_seqlens")
    with pytest.warns(LeakingMixerWarning, match=r"^isolate_seqlens: Mamba2 \(flash-linear-attention; 1 in the "
                                                 r"model: mixer\) takes \*\*kwargs"), \
            pytest.raises(ValueError, match="found no FLA-backed mixer in ModuleDict"):
        isolate_seqlens(nn.ModuleDict({"mixer": layer}))

"""A drop-in binds each call to the replaced forward's signature; under ``torch.compile(fullgraph=True)`` that bind
must not read a mapping proxy built before tracing: transformers' ``can_return_tuple`` pops ``return_dict`` from
the frame's kwargs first, and Dynamo then refuses such a proxy ("mapping proxy affected by dictionary mutation";
transformers' ``test_generate_compile_model_forward_fullgraph`` failed on every swapped family with it)."""

import pytest
import torch
from torch import nn

from fla_ac_isolation.mixers import base


class Replaced(nn.Module):  # the call convention of a replaced class (a cache keyword, an attention mask)
    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        return hidden_states


def _call(module, hidden_states, kwargs):
    kwargs.pop("return_dict", None)  # as transformers' can_return_tuple does, before the model reaches a mixer
    bound = base._bind(Replaced, module, hidden_states, (), kwargs)
    return bound["hidden_states"] * 2 + bound["kwargs"]["cu_seqlens"].sum()


def test_binding_a_call_compiles_in_one_graph_after_the_caller_popped_a_keyword():
    torch._dynamo.reset()
    module, h, cu = Replaced(), torch.ones(1, 4, 2), torch.tensor([0, 1, 4])
    _call(module, h, {"cu_seqlens": cu})  # an eager call first, as a model's warm-up step: whatever it caches exists
    compiled = torch.compile(_call, fullgraph=True, backend="eager")
    got = compiled(module, h, {"return_dict": True, "attention_mask": None, "cu_seqlens": cu})
    assert torch.equal(got, h * 2 + 5)


def test_a_call_the_replaced_forward_does_not_take_is_refused_naming_its_convention():
    with pytest.raises(TypeError) as info:
        base._bind(Replaced, Replaced(), torch.ones(1, 2, 2), (1, 2, 3), {})
    assert str(info.value) == (f"Replaced: too many positional arguments (the call convention of "
                               f"{__name__}.Replaced.forward)")

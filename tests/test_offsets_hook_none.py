"""A hooked call whose hooked offsets argument is ``None`` while offsets arrive under another keyword is refused.

``isolate_seqlens(model, modules=[...], arg_names=["cu_seqlens"])`` on a mixer called with ``cu_seqlens=None``
(keyword or positional) and ``cu_doc_lens=<offsets>``: the hook has nothing to refresh and the shared offsets
would reach FLA under the other name, unchanged (the fault stays). Refusing is right: the hook cannot know that
the forward reads ``cu_doc_lens``, and guessing would isolate offsets it was not told about.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fla_ac_isolation import isolate_seqlens


class Mixer(nn.Module):
    """Records the offsets objects each call receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def forward(self, x, cu_seqlens=None, **kwargs):
        self.seen.append((cu_seqlens, kwargs.get("cu_doc_lens")))
        return x


REFUSAL = ("isolate_seqlens: mixer (Mixer) is hooked to refresh ['cu_seqlens'], but this call passed none of them "
           "and passed the offsets-like keyword(s) ['cu_doc_lens']: the shared offsets would reach FLA unchanged (the "
           "fault stays); if Mixer.forward hands ['cu_doc_lens'] to FLA, hook it with arg_names=['cu_doc_lens']; if it is "
           "a misspelling of ['cu_seqlens'], fix the call")


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_none_for_the_hooked_name_with_offsets_under_another_keyword_is_refused_and_not_counted(how):
    model = nn.ModuleDict({"mixer": Mixer()})
    handle = isolate_seqlens(model, modules=["mixer"], arg_names=["cu_seqlens"])
    cu, x = torch.tensor([0, 2, 5]), torch.randn(1, 5, 4)

    with pytest.raises(ValueError) as refused:
        if how == "keyword":
            model["mixer"](x, cu_seqlens=None, cu_doc_lens=cu)
        else:
            model["mixer"](x, None, cu_doc_lens=cu)
    assert str(refused.value) == REFUSAL
    assert handle.rewritten == 0 and model["mixer"].seen == []

    model["mixer"](x, cu_seqlens=None)  # unpacked: nothing to refresh, nothing refused, not counted
    model["mixer"](x, cu_seqlens=cu)  # the hooked name carries them: refreshed and counted
    (unpacked, _), (fresh, _) = model["mixer"].seen
    assert unpacked is None and fresh is not cu and torch.equal(fresh, cu) and handle.rewritten == 1

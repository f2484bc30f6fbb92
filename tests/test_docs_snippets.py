"""The usage snippet at the top of each model page runs as written and returns ``[1, T, D]``; the OLMo-core
page's complete example runs as written and its isolated AC step matches no AC."""

import re
from pathlib import Path

import pytest
import torch

PAGES = sorted((Path(__file__).parent.parent / "docs" / "models").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_model_page_snippet_runs(page):
    snippet = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, str(page), "exec"), namespace)
    out, seqlens = namespace["out"], namespace["seqlens"]
    assert out.shape == (1, seqlens.num_tokens, namespace["config"].hidden_size)
    assert torch.isfinite(out).all()


def test_olmo_core_page_example_runs_and_its_checkpointed_step_matches_no_ac():
    """The first python block of docs/olmo-core.md, under ReplayAudit (raises at any divergent recompute)."""
    pytest.importorskip("olmo_core")
    from fla_ac_isolation import ReplayAudit

    page = Path(__file__).parent.parent / "docs" / "olmo-core.md"
    snippet = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    namespace: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ReplayAudit(on_divergence="raise") as audit:
            exec(compile(snippet, str(page), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    assert namespace["handle"].paths == [f"blocks.{i}._checkpoint_wrapped_module.attention" for i in range(3)]
    assert len(audit.regions) == 4 and audit.ok
    assert namespace["loss"] == namespace["reference_loss"]
    assert namespace["max_grad_diff"] == 0.0

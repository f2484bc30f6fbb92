"""The usage snippet at the top of each model page runs as written and returns ``[1, T, D]``."""

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

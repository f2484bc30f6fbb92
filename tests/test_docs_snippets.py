"""The usage snippet at the top of each model page runs as written and returns ``[1, T, D]``; the OLMo-core
page's complete example runs as written and its isolated AC step matches no AC, and its second block shows the
shipped model failing; the saveable-ops example of
the benchmarks page runs aligned and equals the saveable model without AC bit for bit; the changelog's
table of moved names points at places that exist and away from places that are gone."""

import pkgutil
import re
from pathlib import Path

import pytest
import torch
from page_output import assert_printed_as_on_page

PAGES = sorted((Path(__file__).parent.parent / "docs" / "models").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_model_page_snippet_runs(page):
    snippet = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, str(page), "exec"), namespace)
    out, seqlens = namespace["out"], namespace["seqlens"]
    assert out.shape == (1, seqlens.num_tokens, namespace["mixer"].hidden_size)
    assert torch.isfinite(out).all()


#: docs/olmo-core.md's printed losses are checked to 5 significant digits: their last digits vary across CPUs
#: (4.868178 on AVX-512, 4.868158 on AVX2 machines), which the page says
OLMO_PAGE_DIGITS = 5


def test_olmo_core_page_examples_isolated_step_matches_no_ac_and_the_shipped_model_fails(capsys):
    """docs/olmo-core.md: the first python block under ReplayAudit (raises at any divergent recompute), then the
    second (the shipped model under selected_ops + every _to_copy, bf16) in the same namespace."""
    pytest.importorskip("olmo_core")
    from fla_ac_isolation import ReplayAudit

    page = Path(__file__).parent.parent / "docs" / "olmo-core.md"
    first, second = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)[:2]
    namespace: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ReplayAudit(on_divergence="raise") as audit:
            exec(compile(first, str(page), "exec"), namespace)
        assert namespace["handle"].paths == [f"blocks.{i}._checkpoint_wrapped_module.attention" for i in range(3)]
        assert len(audit.regions) == 4 and audit.ok
        assert namespace["loss"] == namespace["reference_loss"]
        assert namespace["max_grad_diff"] == 0.0

        exec(compile(second, str(page), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert_printed_as_on_page(out, "docs/olmo-core.md", "isolated: ['blocks.0._checkpoint_wrapped_module.attention', "
                              "'blocks.1._checkpoint_wrapped_module.attention', 'blocks.2._checkpoint_wrapped_module."
                              "attention']", significant=OLMO_PAGE_DIGITS)
    assert_printed_as_on_page(out, "docs/olmo-core.md", "as shipped: RuntimeError: Autograd not support dtype: Int",
                              significant=OLMO_PAGE_DIGITS)
    loss = f"{namespace['reference_loss']:.6f}"
    assert namespace["outcomes"] == {
        "as shipped": "RuntimeError: Autograd not support dtype: Int",
        "isolate_seqlens": f"loss {loss} (no AC {loss}), largest gradient difference 0.0",
    }


def _section_snippet(page: Path, heading: str) -> str:
    """The first python block after ``heading`` on ``page``."""
    text = page.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_saveable_ops_example_runs_aligned_and_equals_the_saveable_model_without_ac_bit_for_bit():
    """docs/benchmarks.md's saveable-ops example (CPU: the reference ops as custom operators), under ReplayAudit;
    then the same weights without AC: equal gradients bit for bit, and off the default path in the last bits."""
    from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit

    page = Path(__file__).parent.parent / "docs" / "benchmarks.md"
    snippet = _section_snippet(page, "## Saveable FLA ops")
    namespace: dict = {}
    with ReplayAudit(on_divergence="raise") as audit:
        exec(compile(snippet, str(page), "exec"), namespace)
    assert len(audit.regions) == 2 and audit.ok
    model, x = namespace["model"], namespace["x"]

    def grads_without_ac(saveable: bool) -> dict:
        plain = namespace["Model"](saveable=saveable)
        plain.load_state_dict(model.state_dict())  # checkpoint_layers keeps the state_dict keys
        plain(x, LayerLocalSeqlens.from_seq_lens([70, 23, 41])).square().mean().backward()
        return dict(plain.named_parameters())

    checkpointed = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    saveable, default = grads_without_ac(True), grads_without_ac(False)
    assert all(torch.equal(checkpointed[n], p.grad) for n, p in saveable.items())
    default_diff = max((checkpointed[n] - p.grad).abs().max().item() for n, p in default.items())
    assert 0.0 < default_diff <= 1e-8, default_diff  # the page says 9.3e-10


def _changelog_tables() -> list[list[tuple[list[str], list[str]]]]:
    """Per version section of docs/changelog.md (``## 0.4.0 ...``; not ``## Unreleased``), newest first: its table's
    rows as ``(old names, new names)``, the dotted ``fla_ac_isolation...`` names of each column."""
    page = (Path(__file__).parent.parent / "docs" / "changelog.md").read_text()
    sections = re.split(r"^## (?=\d)", page, flags=re.M)[1:]
    return [[(_cell_names(row[0]), _cell_names(row[1])) for row in
             (line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `fla_ac_isolation"))]
            for section in sections]


def _cell_names(cell: str) -> list[str]:
    if cell.strip().startswith("nothing"):  # removed with no replacement in this package
        return []
    head = re.match(r"\s*`(fla_ac_isolation[\w.]*)`", cell)
    extra = re.search(r"`(fla_ac_isolation[\w.]*)`\s*\(`([^)]*)\)", cell)
    names = [head.group(1)]
    if extra:  # "module (`A`, `B`)": each name in the brackets lives in that module
        names += [f"{extra.group(1)}.{n.strip(' `')}" for n in extra.group(2).split(",")]
    return names


def test_changelog_new_locations_exist_and_old_ones_are_gone():
    """Each version's table of moved or removed names: its old names are gone (0.4's deprecated aliases included:
    0.5 removed them); the newest table's new names exist, and an older table's new name exists unless a newer
    table moved it again (it is an old name there)."""
    tables = _changelog_tables()
    assert len(tables[0]) >= 40 and len(tables[1]) >= 19 and len(tables[2]) >= 8, "0.5's, 0.4's and 0.3's tables"
    assert {old[0] for old, _ in tables[1]} <= {old[0] for old, _ in tables[0]}, "0.5 lists each 0.4 alias removed"
    moved_later: set[str] = set()
    for table in tables:
        for old, new in table:
            for name in new:
                if not any(name == m or name.startswith(m + ".") for m in moved_later):  # it or its module
                    pkgutil.resolve_name(name)  # raises if the changelog names a place that does not exist
            for name in old:
                with pytest.raises((ModuleNotFoundError, AttributeError)):
                    pkgutil.resolve_name(name)
        moved_later |= {name for old, _ in table for name in old}

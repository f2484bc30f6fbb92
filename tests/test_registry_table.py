"""``docs/foreign-classes.md`` against the registry: its generated block is what the registry renders, and its
measured table has a row for every class the registry names (and names no class the registry lacks)."""

from __future__ import annotations

import re

import pytest

import fla_ac_isolation.harness.registry_table as registry_table
from fla_ac_isolation.families import upstream_mixers
from fla_ac_isolation.foreign_classes import FLA_BACKED_MIXERS, LEAKING_MIXERS, LeakingMixer, drop_in_name

PAGE = registry_table.PAGE


def _block(text: str) -> str:
    start, end = text.index(registry_table.BEGIN) + len(registry_table.BEGIN), text.index(registry_table.END)
    return text[start:end].strip("\n")


def _measured_rows(text: str) -> list[list[str]]:
    """The cells of the measured table (section "The table"), header and rule left out."""
    section = text[text.index("\n## The table\n"):]
    section = section[: section.index("\n## ", 1)]
    lines = [line for line in section.splitlines() if line.startswith("| ")][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def _key(framework_cell: str, class_cell: str) -> str | None:
    """A measured row's class as the tail of its qualified name (``None``: not one named class)."""
    found = re.match(r"`([\w.]+)`", class_cell)
    if found is None:
        return None
    name = found.group(1)
    folder = re.match(r"transformers `(\w+)`", framework_cell)
    return f"{folder.group(1)}.modeling_{folder.group(1)}.{name}" if folder else name


def test_the_pages_registry_block_is_what_the_registry_renders():
    assert _block(PAGE.read_text()) == registry_table.render(), (
        "docs/foreign-classes.md's registry table differs from the registry: run "
        "`python -m fla_ac_isolation.harness.registry_table --write`")


def test_the_block_has_one_row_per_named_class_and_upstream_class():
    rows = registry_table.rows()
    named = (*FLA_BACKED_MIXERS, *LEAKING_MIXERS)
    assert len(rows) == len(named) + 3  # the FLA rule's two kinds, and fla.layers.Mamba2 (a drop-in replaces it)
    assert [(r[0], r[1].strip("`").rpartition(".")[2]) for r in rows[: len(named)]] == [
        (e.framework, e.name) for e in named]
    assert {r[4].strip("`") for r in rows} - {"no drop-in"} == {
        f.drop_in_name(u) for u, f in upstream_mixers()}


def test_a_registry_entry_without_its_row_fails(monkeypatch):
    """The mutation the page test exists for: an entry added to the registry, the page left as it was."""
    page = PAGE.read_text()
    extra = LeakingMixer("transformers.models.new_model.modeling_new_model", "NewMixer", "drops them")
    monkeypatch.setattr(registry_table, "LEAKING_MIXERS", (*LEAKING_MIXERS, extra))
    rendered = registry_table.render()
    assert _block(page) != rendered
    assert "| transformers | `new_model.NewMixer` | none reaches FLA | warned (leaks) | no drop-in |" in rendered
    assert _block(registry_table.replace_block(page)) == rendered


def test_a_page_missing_a_row_fails():
    page = PAGE.read_text()
    row = next(line for line in _block(page).splitlines() if "`kimi_linear.KimiLinearDeltaAttention`" in line)
    assert _block(page.replace(row + "\n", "")) != registry_table.render()


def test_replace_block_refuses_a_page_without_its_markers():
    with pytest.raises(ValueError, match="the page must hold '<!-- registry table"):
        registry_table.replace_block("# a page\n")


def test_the_measured_table_has_a_row_for_every_named_class_and_no_other():
    rows = _measured_rows(PAGE.read_text())
    keys = {_key(r[0], r[1]): r for r in rows}
    named = {e.qualified: e for e in (*FLA_BACKED_MIXERS, *LEAKING_MIXERS)}
    for qualified, entry in named.items():
        matches = [k for k in keys if k and qualified.endswith("." + k)]
        assert matches, f"docs/foreign-classes.md's table has no row for {qualified}"
        answer = keys[matches[0]][4]
        assert ("swap" in answer) == (drop_in_name(entry) is not None), (qualified, answer)
    for key, row in keys.items():
        if row[0].startswith("flash-linear-attention"):  # FLA's classes: the rule, not a list
            continue
        assert key is not None and any(q.endswith("." + key) for q in named), f"row {row[:2]} is not in the registry"


def test_the_measured_table_names_each_fla_class_a_drop_in_replaces():
    rows = _measured_rows(PAGE.read_text())
    for upstream, family in upstream_mixers():
        if not upstream.module.startswith("fla."):
            continue
        (row,) = [r for r in rows if r[0] == "flash-linear-attention" and _key(r[0], r[1]) == upstream.name]
        assert f"swap (`{family.drop_in_name(upstream)}`)" in row[4]

"""examples/hf_swap.py runs on CPU and shows the fault without swap_mixers and the exact match with it."""

from pathlib import Path

import pytest
from helpers import UNSWAPPED_QWEN_UNDER_SAC, load_script
from page_output import assert_printed_as_on_page

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_swap.py"


@pytest.fixture(scope="module")
def hf_swap():
    return load_script(EXAMPLE, "hf_swap_example")


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny model: threads only add contention on 2 cores


def test_example_fails_without_swap_and_matches_with_it(hf_swap, capsys):
    result = hf_swap.main([])

    unswapped, swapped = result["unswapped"], result["swapped"]
    assert "loss" in unswapped["no_ac"]
    UNSWAPPED_QWEN_UNDER_SAC["save-all-copies"].check(unswapped["sac"].get("error"))  # the same model as test_swap
    assert unswapped["max_grad_diff"] is None
    assert result["swapped_paths"] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert swapped["sac"]["loss"] == swapped["no_ac"]["loss"]
    assert swapped["max_grad_diff"] == 0.0
    out = capsys.readouterr().out
    assert "without swap_mixers" in out and "SAC == no AC, bit for bit" in out
    # transformers' fallback warning goes to stderr (the page shows it where a terminal does)
    # the losses' 7th digit varies across CPUs (5.563953 on AVX-512, 5.563952 on SSE4): the page says 6 are checked
    assert_printed_as_on_page(out, "docs/swap.md", "$ python examples/hf_swap.py", skip=("[transformers]",),
                              significant=6)


def test_example_size_flags(hf_swap):
    result = hf_swap.main(["--hidden", "96", "--layers", "2", "--experts", "2", "--doc-lens", "65,9", "--seed", "3"])
    assert result["swapped_paths"] == ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
    assert result["swapped"]["max_grad_diff"] == 0.0

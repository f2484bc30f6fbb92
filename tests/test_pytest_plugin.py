"""The pytest plugin (``fla_ac_isolation.harness.pytest_plugin``): a user's test files, as ``docs/pytest-plugin.md`` shows
them, run by pytest's own ``pytester`` with the plugin loaded by ``-p`` (as the installed ``pytest11`` entry point
loads it): the check passes a safe model, fails an unsafe one with the report (and a test expecting that failure
passes) and fails a blind one with the check's own refusal; the EP=2
regression with a user's mixer class passes this package's GDN and fails a mixer that shares its offsets; the
pages' printed outputs are what these runs print; loading the plugin imports nothing heavy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from page_output import assert_printed_as_on_page

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/pytest-plugin.md"
PLUGIN = "fla_ac_isolation.harness.pytest_plugin"
# the pytester runs: the plugin by name, no cache folder, and the page leaves pytest's warnings summary out
RUN = ("-p", PLUGIN, "-p", "no:cacheprovider")


def _page_python(index: int) -> str:
    return re.findall(r"```python\n(.*?)```", (ROOT / PAGE).read_text(), re.S)[index]


# ------------------------------------------------------------------------------------------- loading
def test_pyproject_registers_the_plugin_module_in_pytest11_under_its_own_name():
    """The name is the module's own: ``-p fla_ac_isolation.harness.pytest_plugin`` then finds the entry point (pytest
    looks entry points up by the ``-p`` name) instead of registering the module a second time under another name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {PLUGIN: PLUGIN}
    module = __import__(PLUGIN, fromlist=["_"])
    assert {"fla_ac_check", "fla_ac_regression", "fla_reference_kernels", "assert_ac_safe",
            "assert_regression_safe"} <= set(module.__all__)


def test_the_installed_distribution_registers_the_same_entry_point():
    # the installed distribution is the one pip wrote (with a direct_url.json); an editable build also leaves
    # fla_ac_isolation.egg-info in the tree, which metadata.distribution() finds first from the repository root
    installed = [d for d in metadata.distributions(name="fla-ac-isolation") if d.read_text("direct_url.json")]
    assert installed, "fla-ac-isolation is not installed by pip (no direct_url.json): run .ci/setup"
    dist = installed[0]
    direct = json.loads(dist.read_text("direct_url.json")).get("url", "")
    if direct != ROOT.as_uri():
        pytest.skip(f"the installed fla-ac-isolation is built from {direct or 'an index'}, not from {ROOT}: its entry "
                    "points are that tree's (reinstall to check this one's)")
    found = {ep.name: ep.value for ep in dist.entry_points if ep.group == "pytest11"}
    assert found == {PLUGIN: PLUGIN}


_IMPORTS = r"""
import json, sys
import fla_ac_isolation.harness.pytest_plugin
heavy = ("torch", "fla", "transformers", "torchtitan", "numpy", "fla_ac_isolation.harness.check.runner",
         "fla_ac_isolation.harness.regression")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""


def test_loading_the_plugin_imports_neither_torch_nor_the_check():
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


def test_the_fixtures_are_offered_once_the_plugin_is_loaded(pytester):
    pytester.makepyfile(test_fixtures="""
        from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe, assert_regression_safe

        def test_fixtures(fla_ac_check, fla_ac_regression):
            assert fla_ac_check is assert_ac_safe and fla_ac_regression is assert_regression_safe
    """)
    pytester.runpytest(*RUN).assert_outcomes(passed=1)
    # switched off (as an installed entry point it loads by itself): no such fixture
    pytester.runpytest("-p", f"no:{PLUGIN}", "-p", "no:cacheprovider").assert_outcomes(errors=1)


OWN_MODEL_PAGE = "docs/own-model.md"


def test_the_own_model_pages_cpu_test_passes_inside_the_served_fixture_and_fails_outside_it(pytester):
    """The page's test file, as a user runs it: its layer imports FLA's op inside its forward; the fixture serves
    it (three calls, packed equal to each document alone). The same test body without the fixture (the unsafe
    path) reaches FLA's op, behind the guard the first run's block left, which names the block."""
    page = re.findall(r"```python\n(.*?)```", (ROOT / OWN_MODEL_PAGE).read_text(), re.S)
    test_file = next(block for block in page if "fla_reference_kernels" in block)
    pytester.makepyfile(test_cpu=test_file)
    pytester.runpytest(*RUN, "-q", "-p", "no:warnings").assert_outcomes(passed=1)

    unserved = test_file.replace("def test_packed_documents_stay_apart(fla_reference_kernels):",
                                 "def test_packed_documents_stay_apart():")
    assert unserved != test_file
    pytester.makepyfile(test_cpu=unserved)
    result = pytester.runpytest(*RUN, "-q", "-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E * RuntimeError: FLA's chunk_gated_delta_rule was called on CPU tensors outside "
                                 "reference_kernels(): FLA's Triton kernels cannot run on a CPU; call it inside a "
                                 "`with reference_kernels():` block (or on CUDA tensors)"])


# ------------------------------------------------------------------------------------------ the check
@pytest.mark.usefixtures("single_thread")
def test_the_check_passes_the_isolated_model_and_fails_the_shared_and_the_blind_one_with_the_report(pytester):
    pytester.makepyfile(test_ac_safety=_page_python(0))
    result = pytester.runpytest(*RUN, "-q")
    result.assert_outcomes(passed=2, failed=2)  # test_shared_offsets_model_is_caught passes: it expects the failure
    out = result.stdout.str()
    assert "PASSED" not in out and "test_isolated_model" not in out  # -q: a passing test prints no line
    result.stdout.fnmatch_lines([
        "*_ test_shared_offsets_model _*",
        "fla-ac-isolation check: Model (given to assert_ac_safe) | SAC policy save-all-copies | cpu (FLA served by "
        "reference_kernels)",
        "FLA-backed classes:",
        "  exposed  Block (your code) x2: layers.0, layers.1; its calls handed FLA the same offsets objects (observed "
        "in the step)",
        "as given: 1 of 2 checkpointed region(s) aligned, 1 DIVERGENT",
        "  layers.0  divergent at op #30 in layers.0: recompute ran aten.new_zeros.default -> [[]1, 2, 16, 16[]] "
        "float32 cpu, forward ran aten.slice.Tensor -> [[]2[]] int32 cpu (FLA cache: prepare_chunk_indices, "
        "prepare_chunk_offsets)",
        "  layers.1  aligned",
        "Fix:",
        "  Block: build a LayerLocalSeqlens once per model forward, hand it to every layer, and call "
        "seqlens.local() inside Block's forward (inside its checkpointed region), giving FLA its tensors "
        "(docs/own-model.md)",
        "verdict: DIVERGENT (exit 1)",
        "*_ test_model_without_fla _*",
        "fla-ac-isolation check refused the model: nothing was judged: the step found no FLA-backed class and its "
        "checkpointed regions called none of FLA's index helpers, so no packed offsets reached FLA and nothing of "
        "the fault could show; check a model whose layers call FLA, with its offsets under the keyword it reads",
    ])
    assert "test_shared_offsets_model_is_caught" not in out and "During handling" not in out
    assert_printed_as_on_page(out, PAGE, "$ python -m pytest -q test_ac_safety.py", skip=("passed",))


def test_what_the_page_tells_a_user_expecting_a_failure_is_what_pytest_raises():
    """``pytest.fail`` raises ``Failed`` (``pytest.fail.Exception``): a ``BaseException``, which
    ``pytest.raises(Exception)`` does not catch (the unsafe way the page warns of)."""
    from _pytest.outcomes import Failed

    assert pytest.fail.Exception is Failed
    assert issubclass(Failed, BaseException) and not issubclass(Failed, Exception)
    caught = None
    try:
        try:
            pytest.fail("a failing model", pytrace=False)
        except Exception:  # what a user's `except Exception` / pytest.raises(Exception) would catch: not this
            caught = "Exception"
    except Failed as failed:
        caught = f"Failed: {failed}"
    assert caught == "Failed: a failing model"
    assert "`pytest.raises(pytest.fail.Exception, match=...)`" in (ROOT / PAGE).read_text()


def test_a_pass_under_full_ac_that_sac_would_fail_warns_with_the_report(recwarn):
    """``ac="full"``, a recompute divergent with the gradients of no AC: the test passes (exit 0) but the
    report, which says SAC would misalign, reaches the test output as a warning; an aligned model warns nothing."""
    from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe

    result = assert_ac_safe("examples/own_decoder.py:plain", ac="full", verify_fix=False)
    assert result.harmless_under_full_ac and result.exit_code == 0
    warned = [w for w in recwarn if issubclass(w.category, UserWarning) and "passed under full AC" in str(w.message)]
    assert len(warned) == 1
    text = str(warned[0].message)
    assert text.startswith("fla-ac-isolation check passed under full AC only: fla-ac-isolation check: Decoder ")
    assert text.endswith("verdict: OK under full AC (exit 0): the gradients are right, but SAC would misalign "
                         "(see above)")
    recwarn.clear()
    assert_ac_safe("examples/own_decoder.py:local", ac="full", verify_fix=False)
    assert not [w for w in recwarn if "passed under full AC" in str(w.message)]


def test_a_refused_input_fails_the_test_with_the_checks_error_and_a_wrong_kind_is_a_type_error():
    import torch

    from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe

    with pytest.raises(pytest.fail.Exception) as info:
        assert_ac_safe(torch.nn.Linear(2, 2), {"input": torch.zeros(1, 2)})
    assert str(info.value).startswith("fla-ac-isolation check refused the model: the batch carries no packed "
                                      "offsets (no 1-D integer tensor, PackedSeqlens or restarting position_ids "
                                      "among model(**batch)'s keywords: input)")
    with pytest.raises(TypeError, match=r"^batch must be a dict of model\(\*\*batch\)'s keyword arguments when model "
                                        r"is an nn.Module, got NoneType$"):
        assert_ac_safe(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^model must be an nn.Module \(with batch\), a callable returning \(model, "
                                        r"batch\), or 'module:callable', got int$"):
        assert_ac_safe(3)
    import fla_ac_isolation.harness.pytest_plugin as plugin

    assert not hasattr(plugin, "_fla_ac_check_target")  # the model served to the check is not kept


def test_a_policy_with_full_ac_fails_the_test_before_the_model_runs():
    """Full AC saves no op: ``assert_ac_safe(ac="full", policy=...)`` would ignore the policy, so it is refused."""
    import torch

    from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe

    class Untouchable(torch.nn.Module):
        def forward(self, **batch):
            raise AssertionError("the model ran")

    with pytest.raises(pytest.fail.Exception) as info:
        assert_ac_safe(Untouchable(), {"cu_seqlens": torch.tensor([0, 4])}, ac="full", policy="save-d2h-copies")
    assert str(info.value) == (
        "fla-ac-isolation check refused the model: policy 'save-d2h-copies' was given with ac='full': full AC "
        "recomputes every op and saves none, so a SAC policy has nothing to choose: leave policy out, or give "
        "ac='selective' to apply it")


def _nemotron_h():
    """transformers' tiny NemotronH: its Mamba2 mixer drops the packed offsets (a leaking class)."""
    from fla_ac_isolation.harness.foreign_models import build_tiny

    model, batch, _ = build_tiny("nemotron_h")
    return model, batch


@pytest.mark.usefixtures("single_thread")
def test_a_model_whose_packed_documents_mix_fails_though_every_region_is_aligned():
    """The verdict is the check's exit code: aligned under AC, the model still mixes its packed documents (exit
    1, LEAKING). The unsafe rule, judging by alignment alone, would pass it: its step is aligned."""
    from fla_ac_isolation.harness.check import CheckSpec, run_check
    from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe

    with pytest.raises(pytest.fail.Exception) as info:
        assert_ac_safe(_nemotron_h, verify_fix=False)
    lines = str(info.value).splitlines()
    assert "  leaking  NemotronHMamba2Mixer (transformers) x2: model.layers.0.mixer, model.layers.2.mixer" in lines
    assert "as given: 4 of 4 checkpointed region(s) aligned" in lines
    assert lines[-1] == "verdict: LEAKING (exit 1): packed documents mix in NemotronHMamba2Mixer"
    result = run_check(CheckSpec(model=_nemotron_h, verify_fix=False))
    assert result.as_given.aligned and result.exit_code == 1  # what the unsafe rule would have read


@pytest.mark.usefixtures("single_thread")
def test_assert_ac_safe_checks_a_copy_and_leaves_the_users_model_as_it_was():
    """The page's isolated model, in eval mode: after the check its modules (no ``CheckpointWrapper``), its
    parameters (values, no ``.grad``) and its training flag are those it had. The unsafe path: the check run on
    the object itself wraps its layers, sets gradients and puts it in training mode."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from fla_ac_isolation.harness.check import CheckSpec, run_check
    from fla_ac_isolation.harness.pytest_plugin import assert_ac_safe

    page: dict = {}
    exec(compile(_page_python(0), PAGE, "exec"), page)
    model = page["Model"](isolated=True).eval()
    modules = [(name, type(m)) for name, m in model.named_modules()]
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = assert_ac_safe(model, page["packed_batch"](), policy="save-all-copies")
    assert result.exit_code == 0
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    assert all(p.grad is None and torch.equal(p, values[n]) for n, p in model.named_parameters())
    assert model.training is False

    given = page["Model"](isolated=True).eval()
    run_check(CheckSpec(model=lambda: (given, page["packed_batch"]()), policy="save-all-copies", verify_fix=False))
    assert [type(layer) for layer in given.layers] == [CheckpointWrapper, CheckpointWrapper]
    assert given.training is True and all(p.grad is not None for p in given.parameters())


# ------------------------------------------------------------------------------- the EP=2 regression
def test_a_mixer_defined_inside_a_function_is_refused_before_any_rank_starts():
    from torch import nn

    from fla_ac_isolation.harness.regression import RegressionSpec

    class Local(nn.Module):
        pass

    name = f"{__name__}:test_a_mixer_defined_inside_a_function_is_refused_before_any_rank_starts.<locals>.Local"
    with pytest.raises(ValueError, match=re.escape(
            f"mixer {name!r} is defined inside a function: the rank processes import the mixer (class or factory) "
            "by module path, so define it at module level")):
        RegressionSpec(mixer=Local).validate()
    with pytest.raises(ValueError, match=re.escape("mixer 'fla_ac_isolation.mixers:Nope': fla_ac_isolation.mixers "
                                                   "has no attribute 'Nope'")):
        RegressionSpec(mixer="fla_ac_isolation.mixers:Nope").validate()
    with pytest.raises(ValueError, match=re.escape(
            "backend applies to this package's mixers; with mixer='fla_ac_isolation.mixers:Qwen3_5MoeGatedDeltaNet' "
            "it must be 'auto' (your mixer picks its own kernels), got 'reference'")):
        RegressionSpec(mixer="fla_ac_isolation.mixers:Qwen3_5MoeGatedDeltaNet", backend="reference").validate()


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_with_our_gdn_passes_and_with_a_mixer_sharing_its_offsets_fails_as_the_shared_path_does(pytester):
    """The user's file of the page: its mixer classes are imported by the rank processes from the test module."""
    pytester.makepyfile(test_mixer_ep2=_page_python(1))
    result = pytester.runpytest(*RUN, "-q", "-p", "no:warnings")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*_ test_kept_offsets_under_ep2 _*",
        "fla-ac-isolation regress: qwen3_5_moe with mixer test_mixer_ep2:KeptOffsetsGatedDeltaNet | EP=2 | SAC "
        "policy save-all-copies | cpu, float32",
        "           no-ac: reference",
        "          shared: FAILED: rank [01]: RuntimeError: Autograd not support dtype: Int (unsafe)",
        "        isolated: FAILED: rank [01]: RuntimeError: Autograd not support dtype: Int (required)",
        "  global-disable: matches (bit for bit) (required)",
        "verdict: FAILED (a required mode does not match no-ac)",
    ])
    assert "test_gated_deltanet_under_ep2" not in result.stdout.str()  # it passed (its own assert included)
    assert_printed_as_on_page(result.stdout.str(), PAGE, "$ python -m pytest -q test_mixer_ep2.py", skip=("passed",),
                              varies=("rank",))


_FLA_MIXER = """
import re

from torch import nn
from fla.layers import GatedDeltaNet

from fla_ac_isolation.harness.pytest_plugin import assert_regression_safe


class FLAGatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.inner = GatedDeltaNet(hidden_size=config.hidden_size, head_dim=config.linear_key_head_dim,
                                   num_heads=config.linear_num_key_heads, num_v_heads=config.linear_num_value_heads,
                                   expand_v=config.linear_value_head_dim / config.linear_key_head_dim,
                                   layer_idx=layer_idx)

    def forward(self, hidden_states, seqlens):
        local = seqlens.local()
        return self.inner(hidden_states, cu_seqlens=local.cu_seqlens)[0]


def test_flas_gated_deltanet_under_ep2():
    found = assert_regression_safe(FLAGatedDeltaNet, device="cpu")
    texts = {mode: verdict.text for mode, verdict in found.items()}
    assert re.fullmatch(r"FAILED: rank [01]: RuntimeError: Autograd not support dtype: Int", texts.pop("shared"))
    assert texts == {"no-ac": "reference", "isolated": "matches (bit for bit)",
                     "global-disable": "matches (bit for bit)"}
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_serves_flas_kernels_on_a_cpu_for_a_mixer_wrapping_flas_gated_deltanet(pytester):
    """No ``rank_setup``: the ranks serve FLA's kernels with ``reference_kernels()`` as ``check`` does (without it
    every mode fails with ``RuntimeError: 0 active drivers ([]). There should only be one.``)."""
    from fla_ac_isolation.harness.regression import RegressionSpec

    spec = RegressionSpec(mixer="fla_ac_isolation.mixers:Qwen3_5MoeGatedDeltaNet", device="cpu")
    assert (spec.rank_setup, spec.kernels, spec.serves_fla_on_cpu) == (None, "native", True)
    assert not RegressionSpec(device="cpu").serves_fla_on_cpu  # the families' own mixers: their reference backend
    pytester.makepyfile(test_fla_mixer=_FLA_MIXER)
    result = pytester.runpytest(*RUN, "-q", "-p", "no:warnings")
    result.assert_outcomes(passed=1)

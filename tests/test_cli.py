"""The ``fla-ac-isolation`` command: its help says what each subcommand does; ``doctor`` lists the versions and
the FLA-backed classes of the installed libraries."""

import argparse
import importlib.metadata
import sys
import types

import pytest

from fla_ac_isolation.harness.cli import audit, check, doctor, main, regress
from fla_ac_isolation.harness.environment import (
    environment_report,
    fla_backed_classes,
    missing_torch_features,
    torch_features,
)


def test_top_level_help_gives_each_subcommand_its_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, module in (("doctor", doctor), ("regress", regress), ("audit", audit), ("check", check)):
        assert f"{name} {module.HELP}" in text


FULL_AC_POLICY = ("--policy torchtitan was given with --ac full: full AC recomputes every op and saves none, so a "
                  "SAC policy has nothing to choose: drop --policy, or use --ac selective to apply it")
POLICY_HELP = "(default: save-all-copies); refused with --ac full, which recomputes every op and saves none"


def _unwrapped(text: str) -> str:
    """``--help`` text on one line (argparse wraps at spaces and after hyphens)."""
    return " ".join(text.split()).replace("- ", "-")


@pytest.mark.parametrize("command", ["audit", "regress"])
def test_audit_and_regress_refuse_a_policy_flag_with_full_ac_and_keep_their_default_policy(capsys, command):
    """They share check's --ac / --policy flags: a --policy given with --ac full (which saved nothing under it)
    exits 2; not given, the spec's default policy applies as before."""
    assert main([command, "--ac", "full", "--policy", "torchtitan"]) == 2
    out, err = capsys.readouterr()
    printed = err if command == "audit" else out  # regress prints its errors on its rich console
    assert " ".join(printed.split()) == f"fla-ac-isolation {command}: error: {FULL_AC_POLICY}"

    module = {"audit": audit, "regress": regress}[command]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)

    def spec(*argv):
        return module.spec_from_arguments(parser.parse_args(list(argv)))

    assert spec().policy is spec("--ac", "full").policy is None  # not given: the spec's default
    assert spec().policy_name == "save-all-copies"
    assert (spec("--ac", "full").ac, spec("--policy", "torchtitan").policy) == ("full", "torchtitan")
    assert ("SAC policy of --ac selective: a name, or your own policy function (ctx, op, *args, **kwargs) -> "
            f"CheckpointPolicy as module:callable or path/to/file.py:callable {POLICY_HELP}") in _unwrapped(
        parser.format_help())


def test_checks_help_says_its_policy_is_for_selective_ac_only(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert ("SAC policy of --ac selective: a name, or your own policy function (ctx, op, *args, **kwargs) -> "
            f"CheckpointPolicy as module:callable or path/to/file.py:callable {POLICY_HELP}") in _unwrapped(
        capsys.readouterr().out)


def test_doctor_says_which_installed_upstream_is_newer_than_ci_has_passed_with(monkeypatch):
    """The table's own versions pass; one release above it (or a newer torch build) is named, the others not."""
    from fla_ac_isolation.harness import environment, tested_versions

    installed = dict(environment.versions())
    monkeypatch.setattr(environment, "versions", lambda: installed)
    for name, version in tested_versions.CI_PASSED.items():
        installed[name] = version
    report = environment_report()
    assert report["CI has passed with"].endswith("(nothing installed here is newer)")
    assert "NEWER" not in " ".join(report.values())

    installed.update({"transformers": "5.26.0", "torch": "2.16.0.dev20261201+cu132", "fla-core": "0.6.0"})
    report = environment_report()
    assert report["transformers"] == "5.26.0 NEWER than CI has passed with (5.25.0): untested"
    assert report["torch"] == "2.16.0.dev20261201+cu132 NEWER than CI has passed with (2.15.0): untested"
    assert report["fla (fla-core)"] == "0.6.0 (tested: <0.7,>=0.5.2)"
    assert report["CI has passed with"].endswith("(newer here, untested: torch, transformers)")
    assert "NEWER" not in report["torch features"]


def test_release_numbers_compare_as_numbers_and_refuse_a_name():
    from fla_ac_isolation.harness.tested_versions import release

    assert release("2.13.0+cpu") == (2, 13, 0) and release("5.9.1") < release("5.25.0")
    with pytest.raises(ValueError, match=r"version must start with a release number \(e.g. '2.13.0'\), got 'dev'"):
        release("dev")


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # OLMo-core on CI's latest stack (it needs torch < 2.14)
        return None


OLMO_CORE = _installed("ai2-olmo-core")


def test_doctor_reports_every_library_the_checks_run_on():
    report = environment_report()
    assert report["OLMo-core (ai2-olmo-core)"] == (OLMO_CORE or "not installed")
    assert report["torchtitan"] == importlib.metadata.version("torchtitan")
    assert report["fla (fla-core)"] == f"{importlib.metadata.version('fla-core')} (tested: <0.7,>=0.5.2)"


# docs/foreign-classes.md's count (flash-linear-attention 0.6); 0.5.2 exports 40 classes, 34 of them reading
# cu_seqlens (it lacks 5 of 0.6's layers, and its LinearAttention drops the offsets)
_FLA_COUNTS = {"0.6": (48, 40, 45), "0.5": (42, 34, 40)}
FLA_COUNT = ("{} classes of fla.layers / fla.models reading cu_seqlens ({} of the {} classes fla.layers exports, "
             "and 8 others: unexported layers, helpers, blocks, feed-forwards)").format(
    *_FLA_COUNTS[".".join(importlib.metadata.version("flash-linear-attention").split(".")[:2])])
CONV_LEAK = ("leaking here (documents are not kept apart): its short conv runs transformers' torch causal_conv1d_fn "
             "across document boundaries (the causal_conv1d package cannot be imported here): ")
GDN_HF = ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen4ExpTextGatedDeltaNet", "Qwen3NextGatedDeltaNet",
          "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet")


def test_doctor_lists_each_installed_fla_backed_class_with_its_status(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # not importable (as on this CPU machine)
    rows = {(r.framework, r.name): r for r in fla_backed_classes()}

    # CI's main job installs every library with FLA-backed classes; OLMo-core does not install beside torch >= 2.14
    assert {r.framework for r in rows.values() if not r.installed} == (set() if OLMO_CORE else {"OLMo-core"})
    assert rows[("transformers", "Qwen3NextGatedDeltaNet")].status == (
        CONV_LEAK + "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.Qwen3NextGatedDeltaNet); the AC fault: "
        "covered by isolate_seqlens (cu_seq_lens_q, cu_seq_lens_k)")
    assert rows[("transformers", "Qwen3_5MoeGatedDeltaNet")].status == (
        CONV_LEAK + "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.Qwen3_5MoeGatedDeltaNet); the AC "
        "fault: covered by isolate_seqlens (cu_seq_lens_q, cu_seq_lens_k)")
    assert all(rows[("transformers", name)].status.startswith(CONV_LEAK) for name in GDN_HF)
    assert rows[("OLMo-core", "GatedDeltaNet")].status == "covered by isolate_seqlens (cu_doc_lens)"
    assert rows[("OLMo-core", "NemotronMamba2Mixer")].status == (
        "leaking (documents are not kept apart): use swap_mixers(model) (drop-in "
        "fla_ac_isolation.mixers.OlmoNemotronMamba2Mixer)")
    assert rows[("flash-linear-attention", FLA_COUNT)].status == (
        "covered by isolate_seqlens (cu_seqlens; found by the FLA rule)")
    assert {n for f, n in rows if f == "flash-linear-attention"} >= {"Mamba2", "BasedLinearAttention"}
    report = environment_report()
    assert report["causal_conv1d"] == (
        f"not importable: 6 classes with a conv that needs it mix packed documents ({', '.join(GDN_HF)}; listed below)")
    assert report["torch features"] == (
        "the 2 this package knows to check, all present: torch.distributed.fsdp.DataParallelMeshDims (torchtitan "
        "0.3's Qwen3.5 model); torch.compiler._is_non_strict_tracing (torchtitan 0.3's EP token dispatcher)")
    assert main(["doctor"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "FLA-backed classes of the installed libraries" in text
    # without OLMo-core: its row of the versions table and the line after the classes
    assert text.endswith("not installed: OLMo-core") is (OLMO_CORE is None)
    assert text.count("not installed") == (0 if OLMO_CORE else 2)


def test_doctor_says_transformers_gdns_are_covered_where_causal_conv1d_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", types.ModuleType("causal_conv1d"))  # a stand-in
    rows = {(r.framework, r.name): r for r in fla_backed_classes()}

    assert rows[("transformers", "Qwen3NextGatedDeltaNet")].status == (
        "covered by isolate_seqlens (cu_seq_lens_q, cu_seq_lens_k); swap_mixers has a drop-in")
    assert rows[("transformers", "Qwen3_5MoeGatedDeltaNet")].status == (
        "covered by isolate_seqlens (cu_seq_lens_q, cu_seq_lens_k); swap_mixers has a drop-in")
    assert environment_report()["causal_conv1d"] == "importable"


def test_tested_fla_range_is_the_install_requirement():
    import tomllib
    from pathlib import Path

    from fla_ac_isolation.fla_seam.versions import tested_range

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (written,) = [d for d in project["dependencies"] if d.startswith("fla-core")]
    assert sorted(tested_range().split(",")) == sorted(written.removeprefix("fla-core").split(","))


def test_doctor_names_each_torch_feature_the_installed_torch_lacks(monkeypatch, capsys):
    import torch.distributed.fsdp

    assert not missing_torch_features(), "torch 2.13 (CI) has every known feature"
    monkeypatch.delattr(torch.distributed.fsdp, "DataParallelMeshDims")
    (missing,) = missing_torch_features()
    assert missing.needs == "torch.distributed.fsdp:DataParallelMeshDims"
    assert missing.reason() == (
        f"torch {torch.__version__} lacks torch.distributed.fsdp.DataParallelMeshDims, which torchtitan 0.3's "
        "Qwen3.5 model (torchtitan.models.qwen3_5; examples/torchtitan_qwen3_5.py) needs (present in torch 2.13, "
        "missing in 2.11)"
    )
    assert main(["doctor"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "lacks torch.distributed.fsdp.DataParallelMeshDims" in text
    assert len(torch_features()) == 2


def test_version_flag_prints_the_installed_distribution_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    # The installed metadata comes from pyproject.toml; the module constant must agree with it.
    assert capsys.readouterr().out == f"fla-ac-isolation {importlib.metadata.version('fla-ac-isolation')}\n"

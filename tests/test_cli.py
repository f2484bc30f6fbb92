"""The ``fla-ac-isolation`` command: its help says what each subcommand does; ``doctor`` lists the versions."""

import importlib.metadata

import pytest

from fla_ac_isolation.cli import audit, doctor, main, regress


def test_top_level_help_gives_each_subcommand_its_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, module in (("doctor", doctor), ("regress", regress), ("audit", audit)):
        assert f"{name} {module.HELP}" in text


def test_doctor_reports_every_library_the_checks_run_on():
    report = doctor.environment_report()
    assert report["OLMo-core (ai2-olmo-core)"] == importlib.metadata.version("ai2-olmo-core")
    assert report["torchtitan"] == importlib.metadata.version("torchtitan")
    assert report["fla (fla-core)"].startswith(importlib.metadata.version("fla-core") + " (tested: ")


def test_version_flag_prints_the_installed_distribution_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    # The installed metadata comes from pyproject.toml; the module constant must agree with it.
    assert capsys.readouterr().out == f"fla-ac-isolation {importlib.metadata.version('fla-ac-isolation')}\n"

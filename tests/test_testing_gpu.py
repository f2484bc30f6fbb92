"""``testing.gpu.host_sync_sites`` without a GPU: torch's sync debug mode is stubbed, its warnings emitted."""

import warnings

import torch

from fla_ac_isolation.harness.testing import gpu


def test_host_sync_sites_counts_sync_warnings_only_and_restores_the_mode(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        # what torch emits: a one-time notice on the first "warn", then one warning per synchronising call
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    with gpu.host_sync_sites() as sites:
        step()
    assert modes == ["warn", "default"]
    assert len(sites) == 2 and all(s.startswith(__file__.split("site-packages/")[-1] + ":") for s in sites)
    assert len(set(sites)) == 2  # two different lines of step()

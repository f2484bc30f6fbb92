"""The CPU stand-in for CUDA's sync debug mode (``testing.sync_ops.SyncOpCounter``): which ops it flags, where."""

import os

import torch

from fla_ac_isolation.harness.testing.sync_ops import SyncOpCounter

HERE = "tests/test_sync_ops.py"


def _line(fn) -> int:
    return fn.__code__.co_firstlineno + 1  # the op is on the first line of each helper's body


def _item(t):
    return t[0].item()


def _mask(t):
    return t[t > 1]


def _repeat(t):
    return torch.repeat_interleave(t, t)


def test_ops_that_read_device_values_on_the_host_are_flagged_where_they_run():
    t = torch.tensor([1, 2, 3])
    with SyncOpCounter() as counter:
        _item(t)
        _mask(t)
        _repeat(t)
        torch.repeat_interleave(t, t, output_size=6)  # sized on the host: no sync
        t.nonzero()
        torch.equal(t, t)
        bool(t[0])
        t + 1
        t.clone()
    sites = [os.path.basename(s) for s in counter.sites()]
    names = [name for name, _ in counter.flagged]
    assert names == ["_local_scalar_dense", "index", "repeat_interleave", "nonzero", "equal", "_local_scalar_dense"]
    assert sites[:3] == [f"test_sync_ops.py:{_line(_item)}", f"test_sync_ops.py:{_line(_mask)}",
                         f"test_sync_ops.py:{_line(_repeat)}"]


def test_ops_on_host_tensors_and_their_results_are_not_flagged():
    """FLA's schedule from host offsets (``_segmented_arange`` of host counts): nothing syncs, since
    ``repeat_interleave`` only reads its ``repeats`` on the host; the same ops on device offsets do."""
    host, device = torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5])
    flagged = []
    for offsets, named in ((host, [host]), (device, [])):
        with SyncOpCounter(host=named) as counter:
            lens = offsets[1:] - offsets[:-1]   # derived from host offsets: a host tensor too
            torch.repeat_interleave(torch.arange(2), lens)
            lens.sum().item()
        flagged.append([name for name, _ in counter.flagged])
    assert flagged == [[], ["repeat_interleave", "_local_scalar_dense"]]

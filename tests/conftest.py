"""Fixtures only; shared helpers live in the ``helpers`` package (imported by the tests as ``from helpers import ...``)."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import CORE_FAMILIES, FAMILIES, HF_KERNEL_FUNCS, MixerFamily

from fla_ac_isolation.harness.transformers_kernels import torch_function


@pytest.fixture
def hf_torch_path(monkeypatch):
    """Force transformers' mixers onto their torch implementations, on CPU and everywhere else.

    transformers binds FLA's ``chunk_gated_delta_rule`` (and mamba_ssm / causal_conv1d when installed) at
    import time through ``use_kernel_func_from_hub_with_fallback``; FLA's Triton kernels then fail on CPU ("0
    active drivers", transformers <= 5.24). The modeling module's global names (``torch_chunk_gated_delta_rule``,
    ``causal_conv1d_fn``, ``mamba2_chunk_scan``, ...) are what each mixer's forward calls; each is pointed at the
    torch function behind it (:func:`~fla_ac_isolation.harness.transformers_kernels.torch_function`) for the test.
    """
    for family in FAMILIES.values():
        module = importlib.import_module(family.hf_module)
        for name in HF_KERNEL_FUNCS:
            fn = torch_function(getattr(module, name, None))
            if fn is not None:
                monkeypatch.setattr(module, name, fn)
    return FAMILIES


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request) -> MixerFamily:
    return FAMILIES[request.param]


@pytest.fixture(params=CORE_FAMILIES, ids=CORE_FAMILIES)
def core_family(request) -> MixerFamily:
    return FAMILIES[request.param]


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: the tiny tensors here gain nothing from two, and on a busy
    2-core machine OpenMP's spinning threads slow small ops down by 10-50x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory):
    """A default process group of one rank (gloo, CPU) for the FSDP2 tests of one module; destroyed after it
    (module scope: other tests in this process must not see an initialised process group).

    Yields a 1-D CPU device mesh over it. FSDP2 (``fully_shard``) runs on it unchanged (a world of one skips
    the all-gather but keeps FSDP's hooks, class renaming and DTensor parameters).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hopper_guard_lifted():
    """GPU test modules: lift FLA's #640 guard (announced on stdout) and autotune with the first config
    only (minutes of compiling saved); yields whether the guard was active."""
    from fla_ac_isolation.harness.fla_seam.interpreter import first_autotune_config
    from fla_ac_isolation.harness.testing.gpu import lift_hopper_gdn_guard

    with lift_hopper_gdn_guard() as lifted, first_autotune_config():
        yield lifted

"""torchtitan's MoE and its expert parallelism, with the environment torchtitan expects, for the regression.
Non-expert gradients are per-rank partial sums (the harness reduces them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from fla_ac_isolation.harness.regression.mesh import ParallelMesh

__all__ = [
    "MoEShape",
    "apply_expert_parallel",
    "build_moe",
    "ensure_torch_compat",
    "expert_parallel_dims",
    "is_expert_param",
    "setup_torchtitan",
]

# torchtitan's own placement of GroupedExperts weights on a (dense) TP axis; unused with EP only, but
# set_moe_sharding_config requires it (as torchtitan's qwen3 sharding plan passes it).
_GROUPED_EXPERTS_TP_LAYOUT = {"w1_EFD": 1, "w2_EDF": 2, "w3_EFD": 1}


def ensure_torch_compat() -> list[str]:
    """Define what torchtitan's EP dispatcher needs and this torch lacks; return notes."""
    notes = []
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
        notes.append(
            f"torch {torch.__version__} lacks torch.compiler._is_non_strict_tracing (torchtitan's EP dispatcher "
            "calls it); defined it, returning False"
        )
    return notes


def setup_torchtitan(device_type: str) -> None:
    """Configure torchtitan's process-wide state (once per process, before meshes): the ``partial_dtensor`` SPMD
    backend, the mesh device, torch's ``fake`` backend for size-1 axes.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
    """
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers backend "fake"
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    parallel_dims_module.device_type = device_type


@dataclass(frozen=True)
class MoEShape:
    """Sizes of one MoE layer.

    Attributes:
        dim: model width ``D``.
        hidden_dim: width of each routed expert's SwiGLU.
        num_experts: routed experts ``E`` (a multiple of the EP degree).
        top_k: experts per token ``K``.
        shared_hidden_dim: width of the shared SwiGLU expert, or ``None`` for none.
        score_func: router activation, ``"softmax"`` (Qwen) or ``"sigmoid"`` (Nemotron-H).
        route_norm: renormalise the top-k scores to sum to 1.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    shared_hidden_dim: int | None = None
    score_func: str = "softmax"
    route_norm: bool = True


def build_moe(shape: MoEShape, *, num_layers: int, ep_enabled: bool) -> nn.Module:
    """Build torchtitan's ``MoE`` for ``shape``, initialised from the global RNG (torchtitan's Qwen3 recipe;
    load-balancing bias off).

    Args:
        shape: layer sizes.
        num_layers: decoder depth (scales the down-projection init).
        ep_enabled: build the EP sharding plan; shard with :func:`apply_expert_parallel` afterwards.
    """
    import spmd_types as spmd
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    normal = partial(nn.init.normal_, std=0.02)
    down = partial(nn.init.normal_, std=0.02 / (2 * num_layers) ** 0.5)
    linear_init = {"weight": normal, "bias": nn.init.zeros_}
    shared = None
    if shape.shared_hidden_dim:
        shared = make_ffn_config(
            dim=shape.dim,
            hidden_dim=shape.shared_hidden_dim,
            w1_param_init=linear_init,
            w2w3_param_init=linear_init,
        )
    config = make_moe_config(
        num_experts=shape.num_experts,
        load_balance_coeff=None,
        router=make_router_config(
            dim=shape.dim,
            num_experts=shape.num_experts,
            gate_param_init=linear_init,
            top_k=shape.top_k,
            score_func=shape.score_func,
            route_norm=shape.route_norm,
        ),
        routed_experts=make_routed_experts_config(
            dim=shape.dim,
            hidden_dim=shape.hidden_dim,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            param_init={"w1_EFD": normal, "w2_EDF": down, "w3_EFD": normal},
            comm_backend="standard",
        ),
        shared_experts=shared,
    )
    set_moe_sharding_config(
        config,
        enable_ep=ep_enabled,
        enable_sp=False,
        expert_param_layout={name: spmd.S(dim) for name, dim in _GROUPED_EXPERTS_TP_LAYOUT.items()},
    )
    moe = config.build()
    moe.init_states()
    return moe


def expert_parallel_dims(mesh: ParallelMesh):
    """torchtitan's ``ParallelDims`` of ``mesh`` (``dp_shard = mesh.dp``), its device meshes built: a rank's
    process groups. Every rank calls it, after :func:`setup_torchtitan`.

    Raises:
        RuntimeError: no default process group of ``mesh.world`` ranks.
    """
    import torch.distributed as dist
    from torchtitan.distributed.parallel_dims import ParallelDims

    if not dist.is_initialized() or dist.get_world_size() != mesh.world:
        found = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise RuntimeError(f"the mesh {mesh.shape} of (pp, dp, cp) needs a default process group of {mesh.world} "
                           f"ranks, found {found}")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=mesh.dp, cp=mesh.cp, tp=1, pp=mesh.pp, ep=mesh.ep, world_size=mesh.world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def apply_expert_parallel(moes: list[nn.Module], dims) -> None:
    """Shard every MoE in ``moes`` over ``dims.ep`` ranks with torchtitan's plan (``E / ep`` experts per rank).

    ``dims``: a built ``ParallelDims`` (:func:`expert_parallel_dims`) or a
    :class:`~fla_ac_isolation.harness.regression.mesh.ParallelMesh`.

    Raises:
        ValueError: the number of experts is not a multiple of ``dims.ep``.
    """
    if isinstance(dims, ParallelMesh):
        dims = expert_parallel_dims(dims)
    for moe in moes:
        experts = moe.routed_experts.inner_experts.num_experts
        if experts % dims.ep:
            raise ValueError(f"num_experts ({experts}) must be a multiple of the EP degree ({dims.ep})")
        moe.parallelize(dims)


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert-parallel shard (a DTensor), whose gradient needs no DP reduction."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)

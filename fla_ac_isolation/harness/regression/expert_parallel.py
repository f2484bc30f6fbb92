"""torchtitan's MoE and its expert parallelism, set up for the regression (gloo on CPU, NCCL on CUDA).

Everything MoE here is torchtitan 0.3's own code: ``MoE`` (``TokenChoiceTopKRouter`` + ``GroupedExperts``
+ optional shared SwiGLU expert) with the ``AllToAllTokenDispatcher`` ("standard" comm backend), built
through torchtitan's config helpers and sharded by torchtitan's ``Module.parallelize`` with its own MoE
sharding plan (``set_moe_sharding_config``): routed-expert weights become DTensors sharded on the expert
dim over the ``ep`` mesh axis, and the dispatcher runs its all-to-alls on that axis.

What this module adds is only the environment torchtitan expects:

* :func:`ensure_torch_compat` - defines ``torch.compiler._is_non_strict_tracing`` (returning ``False``)
  when the installed torch lacks it (torch 2.11), since the EP dispatcher calls it. Returns a note saying
  so; nothing happens on torch versions that have it.
* :func:`setup_torchtitan` - selects torchtitan's ``partial_dtensor`` SPMD backend (its default backend
  sends uneven list all-to-alls that gloo rejects), points torchtitan's mesh code at the CPU when the
  run is on CPU, and registers torch's ``fake`` process-group backend, which torchtitan's mesh builder
  uses for size-1 axes.
* :func:`expert_parallel_dims` / :func:`apply_expert_parallel` - torchtitan's ``ParallelDims`` of a
  :class:`~fla_ac_isolation.parallel.ParallelMesh` (``dp_shard = dp``, ``cp``, ``pp``, ``ep``; no FSDP, no TP),
  a rank's one set of process groups (gradient sums, CP, PP and EP), and the call that shards every MoE of a
  model on it. The EP ranks are the data-parallel ranks, or under
  context parallelism borrowed from the CP ranks, exactly as torchtitan does it (its sparse mesh
  ``(dp_replicate, efsdp, ep)`` with ``efsdp = dp_shard * cp / ep = 1``).

Gradients of non-expert parameters are per-rank partial sums (the data-parallel reduction that FSDP
would do is done by the harness); expert gradients are complete on their owning rank after backward.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from fla_ac_isolation.parallel import ParallelMesh

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
    """Add what torchtitan 0.3's EP dispatcher needs from torch and this torch lacks; return notes.

    torch 2.11 has no ``torch.compiler._is_non_strict_tracing``; the dispatcher calls it to choose its
    all-to-all path. Defining it as ``lambda: False`` is exact outside ``torch.export`` tracing.
    """
    notes = []
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
        notes.append(
            f"torch {torch.__version__} lacks torch.compiler._is_non_strict_tracing (torchtitan's EP dispatcher "
            "calls it); defined it, returning False"
        )
    return notes


def setup_torchtitan(device_type: str) -> None:
    """Configure torchtitan's process-wide state for this run (call once per process, before meshes).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``; torchtitan's mesh builder otherwise assumes its import-time
            guess (``"cuda"`` on a machine without accelerators).
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
        shared_hidden_dim: width of the always-on shared SwiGLU expert, or ``None`` for none.
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
    """Build torchtitan's ``MoE`` for ``shape`` and initialise its parameters (uses the global RNG).

    Initialisation follows torchtitan's Qwen3 recipe: normal(0.02) for the router and the experts, the
    down projection scaled by ``1 / sqrt(2 * num_layers)``. The expert-load-balancing bias is off (it is
    updated by an optimizer hook outside the model, which this regression does not use).

    Args:
        shape: layer sizes.
        num_layers: decoder depth (scales the down-projection init).
        ep_enabled: build the sharding plan for expert parallelism (EP > 1); shard it with
            :func:`apply_expert_parallel` afterwards.
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
    """torchtitan's ``ParallelDims`` of ``mesh`` (``dp_replicate = tp = 1``, ``dp_shard = mesh.dp``), its device
    meshes built: the one set of process groups of a rank (every rank calls it; after :func:`setup_torchtitan`).

    Its ``pp``, ``cp`` and ``loss`` (``dp * cp``: a stage's gradient sum) meshes are the layout of
    :meth:`ParallelMesh.coordinates <fla_ac_isolation.parallel.ParallelMesh.coordinates>` (torchtitan's dense
    order ``(pp, batch, cp, tp)`` with ``tp = 1``); its ``ep`` mesh shards the experts.

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
    """Shard every MoE in ``moes`` over the ``dims.ep`` expert-parallel ranks with torchtitan's plan.

    ``dims`` is the rank's built ``ParallelDims`` (:func:`expert_parallel_dims`; a
    :class:`~fla_ac_isolation.parallel.ParallelMesh` is built into one). Routed-expert weights become
    ``DTensor`` s ``Shard(0)`` on the ``ep`` axis (``E / ep`` local experts per rank); the token dispatcher gets
    the ``ep`` mesh for its all-to-alls.

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

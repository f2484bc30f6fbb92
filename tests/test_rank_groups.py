"""The regression's process groups per rank: torchtitan's ``ParallelDims`` (one set per rank, shared by the
gradient sums, CP, PP and the EP sharding) holds the ranks ``ParallelMesh.coordinates`` places there.

Each rank's groups are built on torch's ``fake`` process-group backend (a default group of the whole world
without peers, one rank at a time) and compared with torch's row-major grid ``torch.arange(world).reshape(shape)``
of ``(pp, dp, cp)``: the gradient group is a stage's ``dp * cp`` ranks, the CP group a data-parallel rank's
``cp`` ranks, the PP group the stages of one ``(dp, cp)`` place, and the EP group (under EP) the gradient group.
"""

import pytest
import torch

from fla_ac_isolation.harness.regression.mesh import ParallelMesh

pytest.importorskip("torchtitan")


@pytest.fixture
def fake_world():
    """``init(rank, world)``: a default process group on torch's ``fake`` backend; destroyed after the test."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    from fla_ac_isolation.harness.regression.expert_parallel import setup_torchtitan

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    setup_torchtitan("cpu")

    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs", [{"ep": 2}, {"cp": 2, "ep": 2}, {"ep": 2, "pp": 2}, {"dp": 2, "cp": 2, "ep": 4, "pp": 2}, {"pp": 2}],
    ids=["ep2", "cp2-ep2", "ep2-pp2", "dp2-cp2-ep4-pp2", "pp2"],
)
def test_each_ranks_groups_are_its_row_of_the_device_mesh_grid(fake_world, kwargs):
    import torch.distributed as dist

    from fla_ac_isolation.harness.regression.train import RankContext

    mesh = ParallelMesh(**kwargs)
    grid = torch.arange(mesh.world).reshape(mesh.shape)  # (pp, dp, cp), row-major as DeviceMesh lays out ranks
    for rank in range(mesh.world):
        fake_world(rank, mesh.world)
        ctx = RankContext.create(rank, mesh, torch.device("cpu"))
        (pp, dp, cp) = (grid == rank).nonzero()[0].tolist()
        assert ctx.coordinates == {"pp": pp, "dp": dp, "cp": cp}
        stage = grid[pp].flatten().tolist()
        assert dist.get_process_group_ranks(ctx.group) == stage
        assert dist.get_process_group_ranks(ctx.cp_group) == grid[pp, dp].tolist()
        assert dist.get_process_group_ranks(ctx.pp_group) == grid[:, dp, cp].tolist()
        if mesh.ep > 1:
            assert dist.get_process_group_ranks(ctx.dims.get_mesh("ep").get_group()) == stage


def test_one_rank_has_no_process_groups():
    from fla_ac_isolation.harness.regression.train import RankContext

    ctx = RankContext.create(0, ParallelMesh(), torch.device("cpu"))
    assert (ctx.dims, ctx.group, ctx.cp_group, ctx.pp_group) == (None, None, None, None)


def test_the_groups_need_a_process_group_of_the_mesh_world(fake_world):
    from fla_ac_isolation.harness.regression.expert_parallel import expert_parallel_dims

    with pytest.raises(RuntimeError) as info:
        expert_parallel_dims(ParallelMesh(ep=2))
    assert str(info.value) == ("the mesh (1, 2, 1) of (pp, dp, cp) needs a default process group of 2 ranks, "
                               "found no process group")
    fake_world(0, 4)
    with pytest.raises(RuntimeError) as info:
        expert_parallel_dims(ParallelMesh(ep=2))
    assert str(info.value) == ("the mesh (1, 2, 1) of (pp, dp, cp) needs a default process group of 2 ranks, "
                               "found 4")


def test_torchtitans_named_meshes_hold_the_grids_groups(fake_world):
    """torchtitan's meshes ``pp``, ``batch``, ``cp`` and ``loss`` (0.3's ``RankContext.meshes`` names ``pp``, ``dp``,
    ``cp``, ``dp_cp``: removed in 0.5) hold the ranks of the ``(pp, dp, cp)`` grid around rank 5."""
    import torch.distributed as dist

    from fla_ac_isolation.harness.regression.rank import RankContext

    mesh = ParallelMesh(dp=2, cp=2, ep=4, pp=2)
    fake_world(5, mesh.world)
    ctx = RankContext.create(5, mesh, torch.device("cpu"))
    assert not hasattr(ctx, "meshes")
    meshes = {name: ctx.dims.get_optional_mesh(name, include_singleton_axes=True) for name in ("pp", "batch", "cp",
                                                                                                "loss")}
    ranks = {name: dist.get_process_group_ranks(m.get_group()) for name, m in meshes.items()}
    grid = torch.arange(mesh.world).reshape(mesh.shape)  # rank 5 is (pp 1, dp 0, cp 1)
    assert ranks == {"pp": grid[:, 0, 1].tolist(), "batch": grid[1, :, 1].tolist(), "cp": grid[1, 0].tolist(),
                     "loss": grid[1].flatten().tolist()}
    assert ranks["loss"] == dist.get_process_group_ranks(ctx.group)
    assert RankContext.create(0, ParallelMesh(), torch.device("cpu")).dims is None

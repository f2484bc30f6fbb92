"""The mesh (``harness.regression.mesh.ParallelMesh``): one owner of the ranks' layout; the regression's spec reads it.

The expected world sizes are today's rules written out (EP ranks are data-parallel ranks without CP, borrowed
from the CP ranks with it); rank coordinates are checked against torch's own row-major layout of a
``DeviceMesh`` (``torch.arange(world).reshape(shape)``), not against the mesh's arithmetic.
"""

import pytest
import torch

from fla_ac_isolation.harness.regression.mesh import ParallelMesh
from fla_ac_isolation.harness.regression.spec import RegressionSpec


@pytest.mark.parametrize(
    ("kwargs", "dp", "world"),
    [
        ({}, 1, 1),
        ({"ep": 2}, 2, 2),          # the README's main job: two data-parallel ranks, experts over both
        ({"ep": 1, "dp": 2}, 2, 2),  # experts replicated over two data-parallel ranks
        ({"cp": 2}, 1, 2),          # experts replicated over the CP ranks
        ({"cp": 2, "ep": 2}, 1, 2),  # EP borrows the CP ranks
        ({"cp": 3, "ep": 3}, 1, 3),
        ({"ep": 2, "pp": 2}, 2, 4),  # stages multiply the world
        ({"dp": 2, "cp": 2, "ep": 4}, 2, 4),
    ],
)
def test_world_is_stages_times_data_times_context_ranks(kwargs, dp, world):
    mesh = ParallelMesh(**kwargs)
    assert (mesh.dp, mesh.world) == (dp, world)
    assert mesh.shape == (mesh.pp, dp, mesh.cp)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cp": 2, "ep": 4}, "ep (4) must be 1 or equal cp (2): the EP ranks are borrowed from the 2 CP ranks (one "
                             "process per CP rank)"),
        ({"dp": 2, "ep": 3}, "ep (3) must be 1 or equal dp (2): the EP ranks are the data-parallel ranks"),
        ({"dp": 2, "cp": 2, "ep": 2}, "ep (2) must be 1 or equal dp * cp (4): the EP ranks are borrowed from the 4 "
                                      "data- and context-parallel ranks of a stage"),
        ({"ep": 0}, "ep must be an int >= 1, got 0"),
        ({"cp": 1.5}, "cp must be an int >= 1, got 1.5"),
        ({"pp": 0}, "pp must be an int >= 1, got 0"),
        ({"pp": True}, "pp must be an int >= 1, got True"),
        ({"dp": 0}, "dp must be an int >= 1, got 0"),
    ],
)
def test_invalid_degrees_name_the_field_and_the_rule(kwargs, message):
    with pytest.raises(ValueError) as info:
        ParallelMesh(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs", [{"ep": 2}, {"cp": 2, "ep": 2}, {"dp": 2, "cp": 3, "pp": 2}])
def test_coordinates_are_torchs_row_major_device_mesh_layout(kwargs):
    mesh = ParallelMesh(**kwargs)
    grid = torch.arange(mesh.world).reshape(mesh.shape)
    for rank in range(mesh.world):
        (where,) = (grid == rank).nonzero().tolist()
        assert mesh.coordinates(rank) == dict(zip(("pp", "dp", "cp"), where))
    with pytest.raises(ValueError, match=rf"rank must be an int in \[0, {mesh.world}\)"):
        mesh.coordinates(mesh.world)


@pytest.mark.parametrize("rank", [-1, -4, 4, True, 1.0, "0"], ids=["-1", "-world", "world", "bool", "float", "str"])
def test_coordinates_refuse_a_rank_outside_the_world_naming_the_argument_and_the_range(rank):
    mesh = ParallelMesh(dp=2, pp=2)  # world 4: a negative rank would otherwise index from the end
    with pytest.raises(ValueError) as info:
        mesh.coordinates(rank)
    assert str(info.value) == f"rank must be an int in [0, 4) (the mesh's world), got {rank!r}"


def test_the_spec_takes_its_ranks_from_the_mesh():
    assert RegressionSpec(ep=2).mesh == ParallelMesh(ep=2)
    assert RegressionSpec(cp=2, ep=2, backend="fla").mesh == ParallelMesh(dp=1, ep=2, cp=2)
    assert RegressionSpec(cp=3, backend="fla").world == 3 and RegressionSpec(ep=4, num_experts=16).world == 4
    with pytest.raises(ValueError, match=r"^ep \(3\) must be 1 or equal cp \(2\)"):
        RegressionSpec(cp=2, ep=3).validate()

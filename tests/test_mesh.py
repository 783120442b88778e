"""hp.mesh: named axes in three spellings, simulated worlds of any size, device detection."""

from __future__ import annotations

import torch

import hp
from hp.device import detect


def test_axes_as_keywords_string_or_pairs_give_the_same_mesh():
    for m in (
        hp.mesh(dp=2, tp=4, simulate=True),
        hp.mesh("dp=2 tp=4", simulate=True),
        hp.mesh([("dp", 2), ("tp", 4)], simulate=True),
    ):
        assert m.mesh_dim_names == ("dp", "tp")
        assert tuple(m.shape) == (2, 4)
        assert m.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_simulated_world_grows_to_the_largest_mesh_and_smaller_meshes_take_its_first_ranks():
    assert hp.mesh(tp=64, simulate=True).size() == 64
    assert torch.distributed.get_world_size() >= 64
    assert torch.distributed.get_backend() == "fake"
    small = hp.mesh(dp=2, cp=2, tp=2, simulate=True)
    assert small.size() == 8 and small.mesh.flatten().tolist() == list(range(8))
    assert torch.distributed.get_world_size() >= 64  # kept: DTensor's cached decisions stay valid


def test_size_one_axes_are_allowed_so_one_plan_runs_at_any_degree():
    m = hp.mesh(dp=2, tp=1, simulate=True)
    assert tuple(m.shape) == (2, 1)


def test_device_detection_on_this_machine():
    device = detect()
    expected = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    assert device.type == expected
    assert device.backend == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device.type, device.backend)
    assert device.pg_backend == "gloo" if device.type == "cpu" else device.pg_backend.startswith("cpu:gloo,")

"""The process grid (lesson 08): rank <-> coordinates, the groups of each dimension, and PyTorch's DeviceMesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.runtime.launch import run


def _grid(monkeypatch, world: int, r: int, **sizes) -> cdist.ProcessGrid:
    """A grid of ``world`` ranks seen from rank ``r``, without processes (no groups are created)."""
    monkeypatch.setattr(cdist, "world_size", lambda: world)
    monkeypatch.setattr(cdist, "rank", lambda: r)
    return cdist.ProcessGrid(**sizes)


def test_coordinates_and_lines_keep_tp_innermost(monkeypatch):
    grid = _grid(monkeypatch, 16, 13, dp=2, pp=4, tp=2)
    assert grid.coords_of(13) == {"pp": 3, "dp": 0, "tp": 1}
    assert [grid.rank_at(**grid.coords_of(r)) for r in range(16)] == list(range(16))
    assert grid.lines("tp")[:3] == [[0, 1], [2, 3], [4, 5]]               # consecutive ranks: inside a node
    assert grid.lines("dp")[:2] == [[0, 2], [1, 3]]
    assert grid.lines("pp")[0] == [0, 4, 8, 12]
    for name in ("dp", "pp", "tp"):                                        # each dimension partitions the world
        assert sorted(r for line in grid.lines(name) for r in line) == list(range(16))
    assert grid.ranks("pp") == [1, 5, 9, 13] and grid.coord("pp") == 3 and grid.coord("tp") == 1
    with pytest.raises(ValueError, match="2 x 2 x 2 = 8, but the world has 16 ranks"):
        _grid(monkeypatch, 16, 0, dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        _grid(monkeypatch, 16, 0, dp=16, tp=0)
    with pytest.raises(ValueError, match="no dimension 'cp'"):
        grid.group("cp")


def test_cp_sits_between_tp_and_dp(monkeypatch):
    """cp (lesson 10) between tp and dp, as Megatron-LM ("tp-cp-ep-dp-pp") and torchtitan (pp, dp, cp, tp) order
    them: rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp, the row-major order of
    ``torch.arange(world).view(pp, dp, cp, tp)``, which is how `init_device_mesh` numbers its mesh."""
    grid = _grid(monkeypatch, 16, 13, dp=2, pp=2, tp=2, cp=2)
    assert grid.coords_of(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    mesh = torch.arange(16).view(2, 2, 2, 2)                               # (pp, dp, cp, tp)
    for r in range(16):
        c = grid.coords_of(r)
        assert mesh[c["pp"], c["dp"], c["cp"], c["tp"]] == r and grid.rank_at(**c) == r
    assert grid.lines("tp")[:2] == [[0, 1], [2, 3]] and grid.lines("cp")[:2] == [[0, 2], [1, 3]]
    assert grid.lines("dp")[:2] == [[0, 4], [1, 5]] and grid.lines("pp")[0] == [0, 8]
    for name in ("dp", "cp", "pp", "tp"):
        assert sorted(r for line in grid.lines(name) for r in line) == list(range(16))
    assert grid.ranks("cp") == [13, 15] and grid.coord("cp") == 0 and grid.ranks("dp") == [9, 13]
    assert repr(grid) == "ProcessGrid(pp=2, dp=2, cp=2, tp=2; rank 13 at pp=1, dp=1, cp=0, tp=1)"
    with pytest.raises(ValueError, match="dp x cp x pp x tp = 2 x 2 x 2 x 1 = 8, but the world has 16 ranks"):
        _grid(monkeypatch, 16, 0, dp=2, pp=2, cp=2)
    with pytest.raises(ValueError, match="cp=0 must be a positive integer"):
        _grid(monkeypatch, 16, 0, dp=16, cp=0)
    plain = _grid(monkeypatch, 16, 13, dp=2, pp=4, tp=2, cp=1)            # cp = 1: the grid of lesson 08, unchanged
    assert plain.dims == ("pp", "dp", "tp") and plain.coords_of(13) == {"pp": 3, "dp": 0, "tp": 1}
    assert repr(plain) == "ProcessGrid(pp=4, dp=2, tp=2; rank 13 at pp=3, dp=0, tp=1)"
    with pytest.raises(ValueError, match="no dimension 'cp' .*build the grid with cp=2 or more"):
        plain.lines("cp")


def _rank_grid_groups(dp: int, pp: int, tp: int, cp_shape: tuple[int, int, int] | None = None) -> dict:
    """Each rank: its groups' members, a sum over each group, and the members of DeviceMesh's groups; with
    ``cp_shape = (dp, cp, tp)`` also those of a second grid with cp and of the mesh ("dp", "cp", "tp")."""
    from torch.distributed.device_mesh import init_device_mesh

    def groups(grid, names):
        out = {}
        for name in names:
            t = torch.tensor([float(cdist.rank())], device=cdist.device())
            dist.all_reduce(t, group=grid.group(name))
            out[name] = {"ranks": grid.ranks(name), "sum": t.item(), "coord": grid.coord(name),
                         "group_rank": dist.get_rank(grid.group(name))}
        return out

    out = groups(cdist.ProcessGrid(dp=dp, pp=pp, tp=tp), ("dp", "pp", "tp"))
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    out["mesh"] = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in ("dp", "pp", "tp")}
    if cp_shape is not None:
        cdp, ccp, ctp = cp_shape
        out["cp_grid"] = groups(cdist.ProcessGrid(dp=cdp, cp=ccp, tp=ctp), ("dp", "cp", "tp"))
        mesh = init_device_mesh("cpu", cp_shape, mesh_dim_names=("dp", "cp", "tp"))
        out["cp_mesh"] = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in ("dp", "cp", "tp")}
    return out


def test_grid_groups_on_8_gloo_ranks_match_device_mesh():
    """2 x 2 x 2 on 8 ranks: an all-reduce over each group sums exactly its members; a rank's index in a group is its
    coordinate; `init_device_mesh` with the same order builds the same groups. The same for dp 2 x cp 2 x tp 2
    against the mesh ("dp", "cp", "tp") (torchtitan's order without pp)."""
    res = run(_rank_grid_groups, nprocs=8, args=(2, 2, 2, (2, 2, 2)), backend="gloo", timeout_s=240, stream=False)
    for r, out in enumerate(res.returns):
        for grid, mesh, names in (("", "mesh", ("dp", "pp", "tp")), ("cp_grid", "cp_mesh", ("dp", "cp", "tp"))):
            for name in names:
                got = out[grid][name] if grid else out[name]
                assert r in got["ranks"] and got["sum"] == sum(got["ranks"]), (r, grid, name, got)
                assert got["group_rank"] == got["coord"] == got["ranks"].index(r)
                assert out[mesh][name] == got["ranks"], (r, grid, name)
    assert res.returns[5]["tp"]["ranks"] == [4, 5] and res.returns[5]["pp"]["ranks"] == [1, 5]
    assert res.returns[5]["cp_grid"]["cp"]["ranks"] == [5, 7] and res.returns[5]["cp_grid"]["dp"]["ranks"] == [1, 5]

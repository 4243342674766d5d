"""The mesh: init_mesh, use_mesh, current_mesh, resolve_axis (single process and via the pool)."""

from __future__ import annotations

import contextvars
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import pshard as ps
from pshard._runtime.mesh import AxisInfo, resolve_axis

_ROOT = Path(__file__).resolve().parents[1]
_NO_MESH = "pshard: no current mesh; create one with ps.init_mesh({...}) or enter ps.use_mesh(mesh)"


def fresh(fn, *args, **kwargs):
    """Run ``fn`` in an empty context, so no current mesh leaks in or out of the test."""
    return contextvars.Context().run(fn, *args, **kwargs)


# ---------------------------------------------------------------- single process


def test_init_mesh_world_of_one():
    def body():
        mesh = ps.init_mesh()
        assert isinstance(mesh, DeviceMesh)
        assert (mesh.mesh_dim_names, tuple(mesh.shape), dist.get_world_size()) == (
            ("world",),
            (1,),
            1,
        )
        assert ps.current_mesh() is mesh
        two = ps.init_mesh({"dp": 1, "sp": 1})
        assert ps.current_mesh() is two and two.mesh_dim_names == ("dp", "sp")
        return True

    assert fresh(body)


@pytest.mark.parametrize(
    ("shape", "error", "text"),
    [
        (
            {"dp": 2},
            ValueError,
            "init_mesh: shape {'dp': 2} has 2 ranks but the world has 1; make the sizes "
            "multiply to 1",
        ),
        ({}, TypeError, "init_mesh: shape must be a non-empty dict of axis name -> size, got {}"),
        (
            [("dp", 1)],
            TypeError,
            "init_mesh: shape must be a non-empty dict of axis name -> size, got [('dp', 1)]",
        ),
        ({1: 1}, TypeError, "init_mesh: axis names must be str, got 1 in shape {1: 1}"),
        ({"dp": 0}, ValueError, "init_mesh: axis 'dp' has size 0; sizes must be ints >= 1"),
        ({"dp": True}, ValueError, "init_mesh: axis 'dp' has size True; sizes must be ints >= 1"),
        ({"dp": 1.0}, ValueError, "init_mesh: axis 'dp' has size 1.0; sizes must be ints >= 1"),
    ],
)
def test_init_mesh_bad_shapes(shape, error, text):
    with pytest.raises(error, match=re.escape(text)):
        fresh(ps.init_mesh, shape)
    with pytest.raises(RuntimeError, match=re.escape(_NO_MESH)):
        fresh(lambda: (_try(ps.init_mesh, shape), ps.current_mesh()))


def _try(fn, *args):
    try:
        fn(*args)
    except (TypeError, ValueError):
        pass


def test_current_mesh_without_a_mesh():
    with pytest.raises(RuntimeError, match=re.escape(_NO_MESH)):
        fresh(ps.current_mesh)


def test_without_a_mesh_each_function_names_itself() -> None:
    x, P = torch.ones(4, 3), ps.P
    calls = {
        "psum": lambda: ps.psum(x, "dp"),
        "shard": lambda: ps.shard(x, P("dp")),
        "shard_map": lambda: ps.shard_map(lambda a: a, in_specs=P("dp"), out_specs=P("dp"))(x),
        "shard_map_seq": lambda: ps.shard_map_seq(
            lambda a: a, in_specs=ps.Shard(1), out_specs=ps.Shard(1)
        )(x),
        "resolve_axis": lambda: resolve_axis("dp", fn="resolve_axis"),
    }
    for name, call in calls.items():
        text = f"{name}: no current mesh; create one with ps.init_mesh({{...}}) or enter"
        with pytest.raises(RuntimeError, match=re.escape(text)):
            fresh(call)


def test_use_mesh_nests_and_restores_also_on_exception():
    def body():
        outer = ps.init_mesh({"a": 1})
        inner = ps.init_mesh({"b": 1})
        assert ps.current_mesh() is inner
        with ps.use_mesh(outer) as got:
            assert got is outer and ps.current_mesh() is outer
            with ps.use_mesh(inner):
                assert ps.current_mesh() is inner
            assert ps.current_mesh() is outer
            with pytest.raises(KeyError):
                with ps.use_mesh(inner):
                    raise KeyError("inside")
            assert ps.current_mesh() is outer
        assert ps.current_mesh() is inner
        return outer

    outer = fresh(body)

    def from_nothing():
        with ps.use_mesh(outer):
            assert ps.current_mesh() is outer
        with pytest.raises(RuntimeError, match=re.escape(_NO_MESH)):
            ps.current_mesh()
        with pytest.raises(TypeError, match=re.escape("use_mesh: expected a DeviceMesh, got dict")):
            with ps.use_mesh({"a": 1}):
                pass

    fresh(from_nothing)


def test_resolve_axis_single_process_and_errors():
    def body():
        mesh = ps.init_mesh({"dp": 1, "sp": 1})
        assert resolve_axis("dp") == AxisInfo(None, 1, 0, "dp")
        assert resolve_axis(("dp", "sp")) == AxisInfo(None, 1, 0, "dp,sp")
        assert resolve_axis(["sp"], mesh=mesh) == AxisInfo(None, 1, 0, "sp")
        assert resolve_axis(dist.group.WORLD) == AxisInfo(None, 1, 0, "group1")
        with pytest.raises(
            ValueError,
            match=re.escape(
                "psum: axis 'tp' is not in the mesh; its axes are ('dp', 'sp') with sizes (1, 1)"
            ),
        ):
            resolve_axis(("dp", "tp"), fn="psum")
        twice = "pshard: axis ('dp', 'dp') names a mesh axis more than once"
        with pytest.raises(ValueError, match=re.escape(twice)):
            resolve_axis(("dp", "dp"))
        for bad in (3, (), ("dp", 1)):
            with pytest.raises(
                TypeError,
                match=re.escape(
                    "all_gather: axis must be a mesh-axis name, a tuple of names or a "
                    f"ProcessGroup, got {bad!r}"
                ),
            ):
                resolve_axis(bad, fn="all_gather")
        return True

    assert fresh(body)
    # an explicit mesh needs no current one; a name without either fails clearly
    mesh = fresh(ps.init_mesh, {"tp": 1})
    assert fresh(resolve_axis, "tp", mesh=mesh) == AxisInfo(None, 1, 0, "tp")
    with pytest.raises(RuntimeError, match=re.escape(_NO_MESH)):
        fresh(resolve_axis, "tp")


# ---------------------------------------------------------------- fresh processes

_FRESH_SCRIPT = """
import json, sys
import torch.distributed as dist
import pshard as ps
try:
    ps.init_mesh({"dp": 0})
except ValueError:
    pass
created_on_error = dist.is_initialized()
mesh = ps.init_mesh()
open("result0.json", "w").write(json.dumps({
    "created_on_error": created_on_error,
    "world": dist.get_world_size(), "rank": dist.get_rank(), "backend": str(dist.get_backend()),
    "names": list(mesh.mesh_dim_names), "shape": list(mesh.shape),
}))
"""

_TORCHRUN_SCRIPT = """
import json
import torch, torch.distributed as dist
import pshard as ps
assert not dist.is_initialized()
mesh = ps.init_mesh({"dp": 2})
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t, group=mesh.get_group("dp"))
open(f"result{dist.get_rank()}.json", "w").write(json.dumps({
    "world": dist.get_world_size(), "rank": dist.get_rank(), "backend": str(dist.get_backend()),
    "names": list(mesh.mesh_dim_names), "sum": t.item(), "current": ps.current_mesh() is mesh,
}))
dist.barrier()  # no rank tears its group down while another still talks to it
dist.destroy_process_group()
"""


def _run_python(args, tmp_path, script):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, *args, str(path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one file per rank: the ranks share stdout, where their lines can interleave
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result*.json"))]


def test_init_mesh_without_torchrun_env_makes_a_world_of_one(tmp_path):
    (result,) = _run_python([], tmp_path, _FRESH_SCRIPT)
    assert result == {
        "created_on_error": False,  # a bad shape is rejected before any group is created
        "world": 1,
        "rank": 0,
        "backend": "gloo",
        "names": ["world"],
        "shape": [1],
    }


def test_init_mesh_under_torchrun(tmp_path):
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    results = _run_python(args, tmp_path, _TORCHRUN_SCRIPT)
    assert results == [
        {"world": 2, "rank": r, "backend": "gloo", "names": ["dp"], "sum": 3.0, "current": True}
        for r in range(2)
    ]


# ---------------------------------------------------------------- via the pool


def _mesh_facts(shape):
    mesh = ps.init_mesh(shape)
    names = mesh.mesh_dim_names
    return {
        "names": names,
        "shape": tuple(mesh.shape),
        "ranks": mesh.mesh.tolist(),
        "local": tuple(mesh.get_local_rank(n) for n in names),
        "current": ps.current_mesh() is mesh,
    }


def test_init_mesh_on_2_and_4_ranks(pool):
    assert pool.run(2, _mesh_facts, {"dp": 2}) == [
        {"names": ("dp",), "shape": (2,), "ranks": [0, 1], "local": (r,), "current": True}
        for r in range(2)
    ]
    assert pool.run(2, _mesh_facts, None)[1]["names"] == ("world",)
    assert pool.run(4, _mesh_facts, {"dp": 2, "sp": 2}) == [
        {
            "names": ("dp", "sp"),
            "shape": (2, 2),
            "ranks": [[0, 1], [2, 3]],
            "local": (r // 2, r % 2),
            "current": True,
        }
        for r in range(4)
    ]
    facts = pool.run(4, _mesh_facts, None)
    assert [f["local"] for f in facts] == [(r,) for r in range(4)]


def test_init_mesh_product_must_match_world(pool):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "init_mesh: shape {'dp': 2, 'sp': 2} has 4 ranks but the world has 2; make the sizes "
            "multiply to 2"
        ),
    ):
        pool.run(2, _mesh_facts, {"dp": 2, "sp": 2})


def _group_facts(info: AxisInfo):
    """Size, rank, label, and the global ranks the group spans in group-rank order."""
    members = [-1]
    if info.group is not None:
        members = [torch.zeros(1) for _ in range(dist.get_world_size(info.group))]
        dist.all_gather(members, torch.tensor([float(dist.get_rank())]), group=info.group)
        members = [int(m.item()) for m in members]
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=info.group)
        assert total.item() == sum(members)
    return info.size, info.rank, info.name, members


def _resolve_on_2x2():
    mesh = ps.init_mesh({"dp": 2, "sp": 2})
    out = {axis: _group_facts(resolve_axis(axis)) for axis in ("dp", "sp", ("dp", "sp"))}
    again = resolve_axis(("dp", "sp"))
    out["cached"] = again.group is resolve_axis(("dp", "sp")).group
    out["world"] = _group_facts(resolve_axis(dist.group.WORLD))
    out["sp_group"] = _group_facts(resolve_axis(mesh.get_group("sp")))
    info = resolve_axis(("sp", "dp"), fn="all_gather")  # JAX's order: sp major
    out["reversed"] = (info.size, info.rank, info.name, info.order)
    return out


def test_resolve_axis_groups_span_the_right_ranks(pool):
    for r, out in enumerate(pool.run(4, _resolve_on_2x2)):
        dp, sp = divmod(r, 2)
        assert out["dp"] == (2, dp, "dp", [sp, sp + 2])
        assert out["sp"] == (2, sp, "sp", [2 * dp, 2 * dp + 1])
        assert out["dp", "sp"] == (4, r, "dp,sp", [0, 1, 2, 3])  # major to minor
        assert out["cached"]
        assert out["world"] == (4, r, "group4", [0, 1, 2, 3])
        assert out["sp_group"] == (2, sp, "group2", [2 * dp, 2 * dp + 1])
        # index 2 * sp + dp; the group is the mesh-ordered one (group rank 2 * dp + sp)
        assert out["reversed"] == (4, 2 * sp + dp, "sp,dp", (0, 2, 1, 3))


def _resolve_with_unit_axis():
    ps.init_mesh({"a": 2, "b": 1, "c": 2})
    return {
        axis: _group_facts(resolve_axis(axis))
        for axis in ("b", ("a", "c"), ("a", "b", "c"), ("b", "c"))
    }


def test_resolve_axis_skips_unit_axes_and_flattens_non_adjacent_ones(pool):
    for r, out in enumerate(pool.run(4, _resolve_with_unit_axis)):
        a, c = divmod(r, 2)
        assert out["b"] == (1, 0, "b", [-1])
        assert out["a", "c"] == (4, r, "a,c", [0, 1, 2, 3])
        assert out["a", "b", "c"] == (4, r, "a,b,c", [0, 1, 2, 3])
        assert out["b", "c"] == (2, c, "b,c", [2 * a, 2 * a + 1])


_FRESH_PROCESS = r"""
import torch.distributed as dist
import pshard as ps

def attempt(**kw):
    try:
        ps.init_mesh(**kw)
    except ValueError as e:
        return str(e)

print(attempt(shape={"x": 3}))
print(dist.is_initialized())
print(attempt(backend="ncl"))
print(attempt(backend="nccl"))
print(dist.is_initialized())
mesh = ps.init_mesh(backend="gloo")
print(dist.get_backend(), mesh.mesh_dim_names)
print(attempt(backend="nccl"))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_init_mesh_failures_leave_nothing_behind():
    """A failed init_mesh leaves no default group (the next call's backend is honoured); bad
    backends are clear errors, not AssertionError / AttributeError."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "init_mesh: shape {'x': 3} has 3 ranks but the world has 1; make the sizes multiply to 1"
    )
    assert lines[1] == "False"
    assert lines[2].startswith("init_mesh: backend='ncl' is not a torch.distributed backend")
    assert lines[3].startswith("init_mesh: backend='nccl' needs CUDA GPUs")
    assert lines[4] == "False"
    assert lines[5] == "gloo ('world',)"
    assert lines[6].startswith(
        "init_mesh: backend='nccl' but the default process group already exists with backend 'gloo'"
    )

"""shard_map against single-process references.

Forward: a plain loop over every mesh coordinate on one process (``ps.shard_tensor`` for the
blocks, ``ps.unshard_tensor`` to assemble), and the unsharded function for bodies that use
collectives. Gradients, jvp, vmap, ...: ``torch.func`` of the unsharded function (or of the
loop), float64. Each worker function runs many checks, on every mesh of its world size.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import pshard as ps

MESHES: dict[int, tuple[dict[str, int], ...]] = {
    1: ({"x": 1},),
    2: ({"x": 2},),
    4: ({"x": 4}, {"dp": 2, "sp": 2}),
}
ROWS = (7, 3, 1, 8)  # uneven on 2 and 4 ranks, fewer rows than ranks, even

f64 = torch.float64


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=f64)


def _all(mesh: dict[str, int]) -> str | tuple[str, ...]:
    """All axes of the mesh as one P entry."""
    names = tuple(mesh)
    return names[0] if len(names) == 1 else names


def _placements(spec: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """DTensor placements (one per mesh dim) of a spec; a P's tuples must be in mesh order."""
    if isinstance(spec, ps.P):
        out = []
        for name in names:
            dims = [d for d, e in enumerate(spec) if e == name or isinstance(e, tuple) and name in e]
            out.append(ps.Shard(dims[0]) if dims else ps.Replicate())
        return tuple(out)
    return (ps.Replicate() if spec is None else spec,) * len(names)


def _coord(mesh: dict[str, int]) -> tuple[int, ...]:
    m = ps.current_mesh()
    return tuple(m.get_local_rank(n) for n in mesh)


def _loop(
    body: Callable, mesh: dict[str, int], args: tuple, in_specs: tuple, out_spec: Any, shape: Any
) -> torch.Tensor:
    """The oracle: ``body`` on every coordinate's blocks, on one process, then assembled."""
    names, sizes = tuple(mesh), tuple(mesh.values())
    blocks = {}
    for c in itertools.product(*map(range, sizes)):
        inner = [
            ps.shard_tensor(a, sizes, c, _placements(s, names))
            for a, s in zip(args, in_specs, strict=True)
        ]
        blocks[c] = body(*inner)
    return ps.unshard_tensor(blocks, shape, sizes, _placements(out_spec, names))


def _check_blocks(seen: list, mesh: dict[str, int], args: tuple, in_specs: tuple) -> None:
    """``fn`` saw exactly this rank's DTensor block of each argument."""
    names, sizes = tuple(mesh), tuple(mesh.values())
    for got, a, s in zip(seen, args, in_specs, strict=True):
        want = ps.shard_tensor(a, sizes, _coord(mesh), _placements(s, names))
        assert got.shape == want.shape, (got.shape, want.shape, s)
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- forward


def _forward_cases(mesh: dict[str, int]) -> list[tuple]:
    """``(body, in_specs, out_spec, args, out_shape)`` for bodies without collectives."""
    ax = _all(mesh)
    cases: list[tuple] = []
    for rows in ROWS:
        x, w = _randn(rows, 5), _randn(5, 3)
        cases += [
            (lambda x: 2 * x + 1, (ps.Shard(0),), ps.Shard(0), (x,), (rows, 5)),
            (torch.cos, (ps.Shard(1),), ps.Shard(1), (_randn(3, rows),), (3, rows)),
            (lambda x: x.T, (ps.P(ax),), ps.P(None, ax), (x,), (5, rows)),
            (lambda x: x * 3, (None,), ps.Replicate(), (x,), (rows, 5)),
            (lambda x, w: x @ w, (ps.P(ax), ps.P()), ps.P(ax), (x, w), (rows, 3)),
            (lambda x: x.sum(0), (ps.Shard(0),), ps.Partial("sum"), (x,), (5,)),
            (lambda x: x.sum(0), (ps.Shard(0),), ps.Partial("max"), (x,), (5,)),
            (lambda x: x.sum(0), (ps.Shard(0),), ps.Partial("min"), (x,), (5,)),
            (lambda x: x.sum(0), (ps.Shard(0),), ps.Partial("mean"), (x,), (5,)),
            (lambda x: x + 1, (ps.StridedShard(0, 2),), ps.StridedShard(0, 2), (x,), (rows, 5)),
        ]
        if len(mesh) == 2:
            cases += [
                (lambda x: 2 * x, (ps.P("dp", "sp"),), ps.P("dp", "sp"), (x,), (rows, 5)),
                (lambda x: x - 1, (ps.P(None, "dp"),), ps.P(None, "dp"), (x,), (rows, 5)),
                (lambda x: x.T, (ps.P("sp"),), ps.P(None, "sp"), (x,), (5, rows)),
                (lambda x: x.sin(), (ps.P(("dp", "sp")),), ps.Shard(0), (x,), (rows, 5)),
                (lambda x: x.sum(2), (ps.P("dp", "sp"),), ps.P("dp", "sp"), (x[None],), (1, rows)),
            ]
    return cases


def _forward_worker(nprocs: int) -> int:
    checks = 0
    for mesh in MESHES[nprocs]:
        ps.init_mesh(mesh)
        for body, in_specs, out_spec, args, shape in _forward_cases(mesh):
            seen: list = []

            def spy(*a: torch.Tensor, body: Callable = body) -> torch.Tensor:
                seen[:] = a
                return body(*a)

            got = ps.shard_map(spy, in_specs=in_specs, out_specs=out_spec)(*args)
            _check_blocks(seen, mesh, args, in_specs)
            assert got.shape == shape, (got.shape, shape, in_specs, out_spec)
            _close(got, _loop(body, mesh, args, in_specs, out_spec, shape))
            checks += 1
        checks += _forward_more(mesh)
    return checks


def _forward_more(mesh: dict[str, int]) -> int:
    ax, n = _all(mesh), ps.axis_size(tuple(mesh))
    x, w = _randn(7, 5), _randn(5, 3)

    # decorator form, pytrees on both sides, collectives inside, non-tensor leaves
    @ps.shard_map(
        in_specs=({"x": ps.Shard(0), "w": None, "k": None},),
        out_specs=({"y": ps.P(ax), "total": None, "n": None}, None),
    )
    def step(batch: dict) -> tuple:
        y = batch["x"] @ batch["w"] * batch["k"]
        return {"y": y, "total": ps.psum(y.sum(0), ax), "n": 3}, "tag"

    out, tag = step({"x": x, "w": w, "k": 2.0})
    assert tag == "tag" and out["n"] == 3
    _close(out["y"], x @ w * 2)
    _close(out["total"], (x @ w * 2).sum(0))

    # reversed axis order in a P: "sp" is the slower axis
    if len(mesh) == 2:
        seen: list = []

        def spy(x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return 2 * x

        rev = ps.P(("sp", "dp"))
        for rows in (8, 5, 3):
            x = _randn(rows, 2)
            seen.clear()
            _close(ps.shard_map(spy, in_specs=rev, out_specs=rev)(x), 2 * x)
            m = ps.current_mesh()
            coord = (m.get_local_rank("sp"), m.get_local_rank("dp"))
            pl = (ps.Shard(0), ps.Shard(0))
            assert torch.equal(seen[0], ps.shard_tensor(x, (2, 2), coord, pl))

    # in_specs=None replicates; kwargs are passed whole; the mesh is current inside
    def body(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        assert ps.current_mesh().mesh_dim_names == tuple(mesh)
        return ps.pmean(x * scale, ax)

    _close(ps.shard_map(body, out_specs=ps.P())(x, scale=w[0, 0]), x * w[0, 0])
    # an explicit mesh that is not the current one
    other = ps.current_mesh()
    with ps.use_mesh(ps.init_mesh({"all": n})):
        f = ps.shard_map(
            lambda x: ps.all_gather(x, ax), mesh=other, in_specs=ps.P(ax), out_specs=ps.P()
        )
        x = _randn(4 * n, 2)
        _close(f(x), x)
    return 4


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_forward_against_loop(pool: Any, nprocs: int) -> None:
    counts = pool.run(nprocs, _forward_worker, nprocs)
    assert counts == [counts[0]] * nprocs and counts[0] > 40

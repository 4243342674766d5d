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
from pshard._tree import tree_flatten as ps_tree_flatten

MESHES: dict[int, tuple[dict[str, int], ...]] = {
    1: ({"x": 1},),
    2: ({"x": 2},),
    4: ({"x": 4}, {"dp": 2, "sp": 2}),
}
ROWS = (7, 3, 1, 8)  # uneven on 2 and 4 ranks, fewer rows than ranks, even

f64 = torch.float64


def _close(a: Any, b: Any) -> None:
    """Same structure, shapes and dtypes, values within 1e-9 (torch.testing.assert_close would
    import DTensor in every worker, seconds on a loaded machine)."""
    la, ta = ps_tree_flatten(a)
    lb, tb = ps_tree_flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        assert torch.allclose(x, y, rtol=1e-9, atol=1e-9, equal_nan=True), (x, y)


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


# --------------------------------------------------------------------------- gradients


def _mlp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((x @ w + b).tanh() ** 2).sum()


def _leaf_grads(f: Callable, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients by ``.backward()``."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    f(*leaves).backward()
    return tuple(leaf.grad for leaf in leaves)


def _grad_worker(nprocs: int) -> list[torch.Tensor]:
    """Gradients through shard_map against torch.func.grad of the unsharded function; returns
    every gradient computed (the caller checks they are identical on every rank)."""
    grads: list[torch.Tensor] = []

    def same(got: Any, want: Any) -> None:
        _close(got, want)
        grads.extend(ps_tree_flatten(got)[0])

    for mesh in MESHES[nprocs]:
        ps.init_mesh(mesh)
        ax = _all(mesh)
        split = (ps.Shard(0), None, None)
        for rows in ROWS:
            x, w, b, v = _randn(rows, 5), _randn(5, 3), _randn(3), _randn(3)
            args = (x, w, b)
            want = grad(_mlp, argnums=(0, 1, 2))(*args)
            psum_inside = ps.shard_map(
                lambda x, w, b: ps.psum(_mlp(x, w, b), ax), in_specs=split, out_specs=ps.P()
            )
            partial_sum = ps.shard_map(_mlp, in_specs=split, out_specs=ps.Partial())
            for f in (psum_inside, partial_sum):
                _close(f(*args), _mlp(*args))
                same(grad(f, argnums=(0, 1, 2))(*args), want)
                same(_leaf_grads(f, *args), want)
            # a gathered output, the loss outside
            act = ps.shard_map(
                lambda x, w, b: (x @ w + b).tanh(), in_specs=split, out_specs=ps.Shard(0)
            )
            same(grad(lambda *a: (act(*a) ** 2).sum(), argnums=(0, 1, 2))(*args), want)
            # a replicated output computed without collectives (cotangent divided, psum'd back)
            rep = ps.shard_map(lambda w: (2 * w).sin(), in_specs=None, out_specs=ps.P())
            same(grad(lambda w: (rep(w) * v).sum())(w), grad(lambda w: ((2 * w).sin() * v).sum())(w))
            # two outputs: a gathered one and a replicated one
            both = ps.shard_map(
                lambda x, w, b: ((x @ w + b).tanh(), ps.psum((x @ w).sum(0), ax)),
                in_specs=split,
                out_specs=(ps.P(ax), ps.P()),
            )

            def mixed(x: Any, w: Any, b: Any, f: Callable = both) -> torch.Tensor:
                act, tot = f(x, w, b)
                return (act**2).sum() + (tot * v).sum()

            def mixed_ref(x: Any, w: Any, b: Any) -> torch.Tensor:
                return ((x @ w + b).tanh() ** 2).sum() + ((x @ w).sum(0) * v).sum()

            same(grad(mixed, argnums=(0, 1, 2))(*args), grad(mixed_ref, argnums=(0, 1, 2))(*args))
            # Partial mean / max / min against the loop (ties split evenly, as amax does)
            for reduce in ("mean", "max", "min"):
                spec = ps.Partial(reduce)

                def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                    return (x @ w).sum(0)

                f = ps.shard_map(body, in_specs=(ps.Shard(0), None), out_specs=spec)

                def loop(x: Any, w: Any, spec: Any = spec, body: Callable = body) -> Any:
                    return _loop(body, mesh, (x, w), (ps.Shard(0), None), spec, (3,))

                _close(f(x, w), loop(x, w))
                same(
                    grad(lambda x, w, f=f: (f(x, w) * v).sum(), argnums=(0, 1))(x, w),
                    grad(lambda x, w, loop=loop: (loop(x, w) * v).sum(), argnums=(0, 1))(x, w),
                )
                _close(jvp(f, (x, w), (x.cos(), w.sin()))[1], jvp(loop, (x, w), (x.cos(), w.sin()))[1])
            if rows == 7:
                grads.extend(_transforms(mesh, args, psum_inside, act))
        if len(mesh) == 2:
            grads.extend(_two_axes(mesh))
    return grads


def _transforms(mesh: dict[str, int], args: tuple, loss: Callable, act: Callable) -> list:
    """jvp, vjp, vmap, jacrev, jacfwd, hessian and vmap(grad) through shard_map."""
    x, w, b = args
    tx, tw, tb = x.sin(), w.cos(), b.exp()

    def act_ref(x: Any, w: Any, b: Any) -> torch.Tensor:
        return (x @ w + b).tanh()

    out = []
    _close(jvp(loss, args, (tx, tw, tb)), jvp(_mlp, args, (tx, tw, tb)))
    _close(jvp(act, args, (tx, tw, tb)), jvp(act_ref, args, (tx, tw, tb)))
    ct = act_ref(*args).cos()
    _close(vjp(act, *args)[1](ct), vjp(act_ref, *args)[1](ct))
    xb, wb = _randn(4, *x.shape), _randn(4, *w.shape)
    _close(vmap(act, in_dims=(0, None, None))(xb, w, b), vmap(act_ref, in_dims=(0, None, None))(xb, w, b))
    _close(vmap(act, in_dims=(None, 0, None))(x, wb, b), vmap(act_ref, in_dims=(None, 0, None))(x, wb, b))
    _close(vmap(act, in_dims=(1, None, None), out_dims=1)(xb.movedim(0, 1), w, b).movedim(1, 0),
           vmap(act_ref, in_dims=(0, None, None))(xb, w, b))
    _close(vmap(loss, in_dims=(0, None, None))(xb, w, b), vmap(_mlp, in_dims=(0, None, None))(xb, w, b))
    gl = vmap(grad(loss), in_dims=(0, None, None))(xb, w, b)
    _close(gl, vmap(grad(_mlp), in_dims=(0, None, None))(xb, w, b))
    jr = jacrev(act, argnums=(0, 1))(*args)
    _close(jr, jacrev(act_ref, argnums=(0, 1))(*args))
    _close(jacfwd(act, argnums=1)(*args), jacfwd(act_ref, argnums=1)(*args))
    hx = hessian(loss, argnums=0)(*args)
    _close(hx, hessian(_mlp, argnums=0)(*args))
    hw = hessian(loss, argnums=1)(*args)
    _close(hw, hessian(_mlp, argnums=1)(*args))
    out += [gl, *jr, hx, hw]
    return out


def _two_axes(mesh: dict[str, int]) -> list[torch.Tensor]:
    """P specs on a (2, 2) mesh: both axes on one dim, on two dims, reversed, one axis only; and
    a map over "sp" alone, "dp" left to the caller."""
    out = []
    x, v, w = _randn(5, 6), _randn(5, 6), _randn(6, 3)

    def ref(x: Any, v: Any) -> torch.Tensor:
        return (x * v).sin().sum()

    for spec in (ps.P("dp", "sp"), ps.P(("dp", "sp")), ps.P(("sp", "dp")), ps.P(None, ("sp", "dp"))):
        f = ps.shard_map(
            lambda x, v: ps.psum((x * v).sin().sum(), ("dp", "sp")),
            in_specs=spec,
            out_specs=ps.P(),
        )
        _close(f(x, v), ref(x, v))
        g = grad(f, argnums=(0, 1))(x, v)
        _close(g, grad(ref, argnums=(0, 1))(x, v))
        out.extend(g)
    # replicated over "dp": the psum runs over "sp" only, the result is replicated over both
    rows_sp = ps.shard_map(
        lambda x, w: ps.psum(((x @ w) ** 2).sum(), "sp"), in_specs=(ps.P("sp"), None),
        out_specs=ps.P(),
    )
    inner_dp = ps.shard_map(  # a contraction split over "dp": psum the partial products
        lambda x, w: (ps.psum(x @ w, "dp") ** 2).sum(), in_specs=(ps.P(None, "dp"), ps.P("dp")),
        out_specs=ps.P(),
    )
    want = grad(lambda x, w: ((x @ w) ** 2).sum(), argnums=(0, 1))(x, w)
    for f in (rows_sp, inner_dp):
        _close(f(x, w), ((x @ w) ** 2).sum())
        g = grad(f, argnums=(0, 1))(x, w)
        _close(g, want)
        out.extend(g)
    # gathered over "sp", replicated over "dp"
    f = ps.shard_map(lambda x: x.exp(), in_specs=ps.P("sp"), out_specs=ps.P("sp"))
    g = grad(lambda x: (f(x) * v).sum())(x)
    _close(g, x.exp() * v)
    out.append(g)
    # map "sp" only: values differ along "dp" (data parallel), which fn may use itself
    dp = ps.axis_index("dp")
    xd = x + dp
    f = ps.shard_map(
        lambda x: ps.psum((x**3).sum(), "sp"), axis_names="sp", in_specs=ps.P("sp"), out_specs=ps.P()
    )
    _close(f(xd), (xd**3).sum())
    _close(grad(f)(xd), 3 * xd**2)
    gathered = ps.shard_map(
        lambda x: x * ps.axis_size("dp"), axis_names={"sp"}, in_specs=ps.P(None, "sp"),
        out_specs=ps.P(None, "sp"),
    )
    _close(gathered(xd), 2 * xd)
    g = grad(lambda x: (gathered(x) * v).sum())(xd)
    _close(g, 2 * v)
    out.append(g)
    return out


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_gradients_match_single_process(pool: Any, nprocs: int) -> None:
    per_rank = pool.run(nprocs, _grad_worker, nprocs)
    assert len(per_rank[0]) > 50
    for rank, grads in enumerate(per_rank[1:], 1):
        for i, (a, b) in enumerate(zip(per_rank[0], grads, strict=True)):
            if not torch.equal(a, b):
                raise AssertionError(f"gradient {i} differs between rank 0 and rank {rank}")

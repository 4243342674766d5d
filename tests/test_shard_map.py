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
from pshard._core.tree import tree_flatten as ps_tree_flatten

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
            dims = [
                d for d, e in enumerate(spec) if e == name or isinstance(e, tuple) and name in e
            ]
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
            (
                lambda i: i * 2,
                (ps.Shard(0),),
                ps.Shard(0),
                (torch.arange(rows * 2).view(rows, 2),),
                (rows, 2),
            ),
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


def _forward_case(
    mesh: dict[str, int], body: Callable, in_specs: tuple, out_spec: Any, args: tuple, shape: Any
) -> None:
    seen: list = []

    def spy(*a: torch.Tensor) -> torch.Tensor:
        seen[:] = a
        return body(*a)

    got = ps.shard_map(spy, in_specs=in_specs, out_specs=out_spec)(*args)
    _check_blocks(seen, mesh, args, in_specs)
    assert got.shape == shape, (got.shape, shape, in_specs, out_spec)
    _close(got, _loop(body, mesh, args, in_specs, out_spec, shape))


def _forward_worker(nprocs: int) -> int:
    checks = 0
    for mesh in MESHES[nprocs]:
        ps.init_mesh(mesh)
        for case in _forward_cases(mesh):
            _forward_case(mesh, *case)
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
    for mesh in MESHES[nprocs]:
        ps.init_mesh(mesh)
        for rows in ROWS[:3]:  # the even case is in the forward tests and in _two_axes
            grads.extend(_grad_rows(mesh, rows))
        if len(mesh) == 2:
            grads.extend(_two_axes(mesh))
    return grads


def _grad_rows(mesh: dict[str, int], rows: int) -> list[torch.Tensor]:
    grads: list[torch.Tensor] = []

    def same(got: Any, want: Any) -> None:
        _close(got, want)
        grads.extend(ps_tree_flatten(got)[0])

    ax = _all(mesh)
    split = (ps.Shard(0), None, None)
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
    act = ps.shard_map(lambda x, w, b: (x @ w + b).tanh(), in_specs=split, out_specs=ps.Shard(0))
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

    def mixed(x: Any, w: Any, b: Any) -> torch.Tensor:
        act, tot = both(x, w, b)
        return (act**2).sum() + (tot * v).sum()

    def mixed_ref(x: Any, w: Any, b: Any) -> torch.Tensor:
        return ((x @ w + b).tanh() ** 2).sum() + ((x @ w).sum(0) * v).sum()

    same(grad(mixed, argnums=(0, 1, 2))(*args), grad(mixed_ref, argnums=(0, 1, 2))(*args))
    for reduce in ("mean", "max", "min") if rows != 3 else ():
        grads.extend(_grad_partial(mesh, ps.Partial(reduce), x, w, v))
    if rows == 7:
        grads.extend(_transforms(mesh, args, psum_inside, act))
    return grads


def _grad_partial(
    mesh: dict[str, int], spec: ps.Partial, x: torch.Tensor, w: torch.Tensor, v: torch.Tensor
) -> list[torch.Tensor]:
    """Partial mean / max / min against the loop (ties split evenly, as amax does)."""

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sum(0)

    f = ps.shard_map(body, in_specs=(ps.Shard(0), None), out_specs=spec)

    def loop(x: Any, w: Any) -> Any:
        return _loop(body, mesh, (x, w), (ps.Shard(0), None), spec, (3,))

    _close(f(x, w), loop(x, w))
    got = grad(lambda x, w: (f(x, w) * v).sum(), argnums=(0, 1))(x, w)
    _close(got, grad(lambda x, w: (loop(x, w) * v).sum(), argnums=(0, 1))(x, w))
    tangents = (x.cos(), w.sin())
    _close(jvp(f, (x, w), tangents)[1], jvp(loop, (x, w), tangents)[1])
    return list(got)


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
    _close(
        vmap(act, in_dims=(0, None, None))(xb, w, b),
        vmap(act_ref, in_dims=(0, None, None))(xb, w, b),
    )
    _close(
        vmap(act, in_dims=(None, 0, None))(x, wb, b),
        vmap(act_ref, in_dims=(None, 0, None))(x, wb, b),
    )
    _close(
        vmap(act, in_dims=(1, None, None), out_dims=1)(xb.movedim(0, 1), w, b).movedim(1, 0),
        vmap(act_ref, in_dims=(0, None, None))(xb, w, b),
    )
    _close(
        vmap(loss, in_dims=(0, None, None))(xb, w, b), vmap(_mlp, in_dims=(0, None, None))(xb, w, b)
    )
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

    for spec in (
        ps.P("dp", "sp"),
        ps.P(("dp", "sp")),
        ps.P(("sp", "dp")),
        ps.P(None, ("sp", "dp")),
    ):
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
        lambda x, w: ps.psum(((x @ w) ** 2).sum(), "sp"),
        in_specs=(ps.P("sp"), None),
        out_specs=ps.P(),
    )
    inner_dp = ps.shard_map(  # a contraction split over "dp": psum the partial products
        lambda x, w: (ps.psum(x @ w, "dp") ** 2).sum(),
        in_specs=(ps.P(None, "dp"), ps.P("dp")),
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
        lambda x: ps.psum((x**3).sum(), "sp"),
        axis_names="sp",
        in_specs=ps.P("sp"),
        out_specs=ps.P(),
    )
    _close(f(xd), (xd**3).sum())
    _close(grad(f)(xd), 3 * xd**2)
    gathered = ps.shard_map(
        lambda x: x * ps.axis_size("dp"),
        axis_names={"sp"},
        in_specs=ps.P(None, "sp"),
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


# --------------------------------------------------------------------------- run-time checks


def _message(f: Callable, *args: Any) -> str | None:
    try:
        f(*args)
    except ValueError as e:
        return str(e)
    return None


def _check_worker(nprocs: int) -> dict[str, str | None]:
    """check_rep and the other run-time errors, raised on every rank; returns the messages."""
    out: dict[str, str | None] = {}
    for mesh in MESHES[nprocs]:
        ps.init_mesh(mesh)
        _check_mesh(mesh, nprocs, out)
    return out


def _check_mesh(mesh: dict[str, int], nprocs: int, out: dict[str, str | None]) -> None:
    rank = dist.get_rank()
    ax, key = _all(mesh), "x".join(map(str, mesh.values()))
    x = _randn(6, 2)
    f = ps.shard_map(lambda x: 2 * x, in_specs=ps.P(ax), out_specs=ps.P(ax), check_rep=True)
    _close(f(x), 2 * x)  # equal inputs pass
    signed = torch.tensor([torch.nan, -0.0 if rank % 2 else 0.0], dtype=f64)
    _close(f(signed), 2 * signed)  # NaN == NaN and -0.0 == 0.0 for the check
    bad = x + (rank == nprocs - 1)
    out[f"input {key}"] = _message(f, bad)
    out[f"shape {key}"] = _message(f, x[: 6 - (rank == 1)])
    out[f"dtype {key}"] = _message(f, x.float() if rank == 0 else x)
    unchecked = ps.shard_map(lambda x: 2 * x, in_specs=ps.P(ax), out_specs=ps.P(ax))
    out[f"unchecked {key}"] = _message(unchecked, bad)
    with ps.debug(True):  # debug mode turns the check on
        plain = ps.shard_map(lambda x: x, in_specs=None, out_specs=ps.P())
        out[f"debug {key}"] = _message(plain, bad)
    local = ps.shard_map(
        lambda x: {"loss": x.sum(), "n": 1}, in_specs=ps.P(ax), out_specs=ps.P(), check_rep=True
    )
    out[f"output {key}"] = _message(local, x)
    # blocks that are not torch.chunk's
    ragged = ps.shard_map(
        lambda t: (t[0][: ps.axis_index(ax) + 1],), in_specs=None, out_specs=(ps.P(ax),)
    )
    out[f"ragged {key}"] = _message(ragged, (x,))
    ndims = ps.shard_map(
        lambda x: x[0] if ps.axis_index(ax) else x, in_specs=None, out_specs=ps.Shard(0)
    )
    out[f"ndims {key}"] = _message(ndims, x)
    if len(mesh) == 2:  # replicated over "dp" only, differing along it
        along = ps.shard_map(
            lambda x: x + ps.axis_index("dp"),
            in_specs=ps.P("sp"),
            out_specs=ps.P("sp"),
            check_rep=True,
        )
        out["output along dp"] = _message(along, x)


IN = (
    "shard_map in_specs[0] ({spec}): check_rep: inputs must be the same on every rank of the "
    "mapped axes {axes} (shard_map takes each rank's block itself), but this one differs; pass "
    "the same value on every rank; global ranks holding equal values: {groups}"
)
OUT = (
    "shard_map out_specs['loss'] (P()): check_rep: P() says this output is the same on every "
    "rank of axes {axes} but fn returned different values; reduce it inside fn (ps.psum, "
    "ps.pmean), or give it Partial(...) or a spec that splits it; global ranks holding equal "
    "values: {groups}"
)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_run_time_checks(pool: Any, nprocs: int) -> None:
    per_rank = pool.run(nprocs, _check_worker, nprocs)
    for mesh in MESHES[nprocs]:
        key, names = "x".join(map(str, mesh.values())), tuple(mesh)
        spec = ps.P(_all(mesh))
        others = ", ".join(map(str, range(nprocs - 1)))
        for got in per_rank:
            assert got[f"input {key}"] == IN.format(
                spec=spec, axes=names, groups=f"[{others}] vs [{nprocs - 1}]"
            )
            assert got[f"unchecked {key}"] is None
            want = [f"global rank {r}: (6, 2) float64" for r in range(nprocs)]
            want[1] = "global rank 1: (5, 2) float64"
            assert got[f"shape {key}"] == IN.format(spec=spec, axes=names, groups="").replace(
                "; global ranks holding equal values: ",
                f"; the ranks hold different shapes or dtypes ({', '.join(want)})",
            )
            want = [f"global rank {r}: (6, 2) float64" for r in range(nprocs)]
            want[0] = "global rank 0: (6, 2) float32"
            assert got[f"dtype {key}"].endswith(f"({', '.join(want)})")
            assert got[f"debug {key}"] == IN.format(
                spec="Replicate()", axes=names, groups=f"[{others}] vs [{nprocs - 1}]"
            )
            groups = " vs ".join(f"[{r}]" for r in range(nprocs))
            assert got[f"output {key}"] == OUT.format(axes=names, groups=groups)
            sizes = ", ".join(f"rank {r}: ({r + 1}, 2)" for r in range(nprocs))
            total = nprocs * (nprocs + 1) // 2
            assert got[f"ragged {key}"].startswith(
                f"shard_map out_specs[0] ({spec}): the blocks returned on the ranks of axes "
                f"{names} have shapes ({sizes}), which is not how the spec splits a "
                f"tensor of shape ({total}, 2) (torch.chunk sizes: rank 0: "
            )
            assert got[f"ndims {key}"].startswith(
                f"shard_map out_specs (Shard(0)): the ranks of axes {names} returned "
                f"blocks with different numbers of dims (rank 0: (6, 2), rank 1: (2,)"
            )
        if len(mesh) == 2:
            for rank, got in enumerate(per_rank):
                sp = rank % 2
                assert got["output along dp"] == (
                    "shard_map out_specs (P('sp')): check_rep: P('sp') says this output is the "
                    "same on every rank of axes ('dp',) but fn returned different values; reduce "
                    "it inside fn (ps.psum, ps.pmean), or give it Partial(...) or a spec that "
                    f"splits it; global ranks holding equal values: [{sp}] vs [{sp + 2}]"
                )


# --------------------------------------------------------------------------- spec errors


@pytest.fixture
def mesh11() -> Any:
    mesh = ps.init_mesh({"dp": 1, "sp": 1})
    with ps.use_mesh(mesh):
        yield mesh


def _raises(exc: type, text: str) -> Any:
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def test_spec_errors(mesh11: Any) -> None:
    x = torch.zeros(4, 3)
    sm = ps.shard_map

    def ident(a: Any) -> Any:
        return a

    with _raises(
        ValueError,
        "shard_map in_specs[0]: the spec is a dict with keys ['a'] but the value is a dict with "
        "keys ['b'] (missing from the spec: ['b']; not in the value: ['a'])",
    ):
        sm(ident, in_specs=({"a": ps.P()},), out_specs=ps.P())({"b": x})
    with _raises(
        ValueError,
        "shard_map out_specs: the spec is a dict with keys ['los'] but the value is a dict with "
        "keys ['loss'] (missing from the spec: ['loss']; not in the value: ['los'])",
    ):
        sm(lambda a: {"loss": a}, in_specs=ps.P(), out_specs={"los": ps.P()})(x)
    with _raises(
        ValueError,
        "shard_map in_specs[0]: P('tp') names mesh axis 'tp', which is not in the mesh (axes "
        "('dp', 'sp') with sizes (1, 1)); use one of the mapped axes ('dp', 'sp')",
    ):
        sm(ident, in_specs=ps.P("tp"), out_specs=ps.P())(x)
    with _raises(
        ValueError,
        "shard_map in_specs[1]['w']: P(None, 'dp') names mesh axis 'dp', which this shard_map "
        "does not map (axis_names=('sp',)); add 'dp' to axis_names, or leave it out of the spec "
        "(unmapped axes are left to the caller)",
    ):
        sm(
            lambda a, b: a,
            in_specs=(None, {"w": ps.P(None, "dp")}),
            out_specs=ps.P(),
            axis_names="sp",
        )(x, {"w": x})
    with _raises(
        ValueError,
        "shard_map out_specs: P('dp') names mesh axis 'dp', which this shard_map does not map "
        "(axis_names=('sp',)); add 'dp' to axis_names, or leave it out of the spec (unmapped "
        "axes are left to the caller)",
    ):
        sm(ident, in_specs=ps.P(), out_specs=ps.P("dp"), axis_names=("sp",))(x)
    with _raises(
        ValueError,
        "shard_map in_specs[0]: P('sp', None, 'dp') has 3 entries but the tensor has 2 dims "
        "(shape (4, 3)); give at most one entry per tensor dim",
    ):
        sm(ident, in_specs=ps.P("sp", None, "dp"), out_specs=ps.P())(x)
    with _raises(ValueError, "P('sp', 'sp'): mesh axis 'sp' is used more than once"):
        ps.P("sp", "sp")
    with _raises(ValueError, "P(('dp', 'sp'), 'sp'): mesh axis 'sp' is used more than once"):
        ps.P(("dp", "sp"), "sp")
    with _raises(
        ValueError,
        "shard_map in_specs[0]: Partial('sum') cannot be an input spec: values outside shard_map "
        "are whole (the same on every rank of the mapped axes), so there is no pending "
        "reduction; use Replicate() (or None) to give every rank the whole value, or Shard(d) / "
        "P(...) to split it",
    ):
        sm(ident, in_specs=ps.Partial(), out_specs=ps.P())(x)
    with _raises(
        ValueError,
        "shard_map in_specs[0]: Shard(2) but the tensor has 2 dims (shape (4, 3)); did you mean "
        "Shard(1)?",
    ):
        sm(ident, in_specs=ps.Shard(2), out_specs=ps.P())(x)
    with _raises(
        ValueError,
        "shard_map out_specs['n']: Partial('sum') but the value is an int (3), not a tensor; "
        "only tensors can be reduced over the mapped axes: return a tensor, or give it "
        "Replicate() or None",
    ):
        sm(lambda a: {"n": 3}, in_specs=ps.P(), out_specs={"n": ps.Partial()})(x)
    with _raises(
        ValueError,
        "shard_map: axis_names names 'tp', which is not an axis of the mesh (axes ('dp', 'sp') "
        "with sizes (1, 1)); use mesh axis names",
    ):
        sm(ident, in_specs=ps.P(), out_specs=ps.P(), axis_names="tp")(x)


def test_argument_errors(mesh11: Any) -> None:
    def loss(a: Any) -> Any:
        return a

    missing = (
        "shard_map(loss): out_specs omitted and the return annotation of loss carries no spec; "
        "pass out_specs=... (a prefix tree of the output) or annotate the return, e.g. "
        "-> Annotated[torch.Tensor, ps.Replicate()]"
    )
    with _raises(TypeError, missing):
        ps.shard_map(loss, in_specs=ps.P())
    with _raises(TypeError, missing):
        ps.shard_map(in_specs=ps.P())(loss)
    with _raises(
        TypeError, "shard_map: axis_names must be a mesh-axis name or a collection of names, got 3"
    ):
        ps.shard_map(loss, out_specs=ps.P(), axis_names=3)
    with _raises(TypeError, "shard_map: mesh must be a DeviceMesh, got a str ('sp')"):
        ps.shard_map(loss, out_specs=ps.P(), mesh="sp")
    with _raises(TypeError, "shard_map: fn must be callable, got an int (3)"):
        ps.shard_map(3, out_specs=ps.P())
    with _raises(
        TypeError,
        "shard_map in_specs[1]: expected a placement (Shard, StridedShard, Replicate, Partial), "
        "a P(...) or None as the spec, got a str ('sp')",
    ):
        ps.shard_map(lambda a, b: a, in_specs=(None, "sp"), out_specs=ps.P())(1, 2)


def test_one_rank_is_free(mesh11: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rank on the mapped axes fn gets the inputs themselves and nothing communicates."""

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("communication with one rank")

    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, boom)
    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(3)
    seen = []

    def body(x: torch.Tensor, w: torch.Tensor) -> tuple:
        seen.extend([x, w])
        return x, (x @ w).sum(), x @ w

    f = ps.shard_map(
        body,
        in_specs=(ps.P(("dp", "sp")), None),
        out_specs=(ps.Shard(0), ps.Partial("mean"), ps.Partial("max")),
        check_rep=True,
    )
    a, b, c = f(x, w)
    assert seen[0] is x and seen[1] is w and a is x
    b.backward()
    _close(x.grad, w.expand(5, 3))
    assert torch.equal(c, x @ w)

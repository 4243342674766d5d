"""pshard's collectives against single-process references, under every torch.func transform.

Each rank of a pool runs the SPMD program on its slice of stacked inputs ``X[r]``; the test
process runs the reference collective on the whole stack ``X`` (shape ``(n, *local)``) and the
same transform, and compares rank ``r``'s answer with slice ``r``. The SPMD convention: rank
``r``'s gradient is the derivative of the sum over ranks of the per-rank losses with respect to
``X[r]``; forward-mode tangents move every rank's input at once. So ``jacrev`` on rank ``r`` is
``sum_s J[s, r]`` and ``jacfwd`` is ``sum_s J[r, s]`` of the full Jacobian ``J[s, r] = dY_s/dX_r``.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import func

import pshard as ps
from pshard._core import tree as pshard_tree

# torch.func.jvp scripts its decompositions on first use, which warns on torch 2.13
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

WORLDS = (1, 2, 4)
B = 3  # vmap batch size


# --- cases --------------------------------------------------------------------------------------


def _cases(name: str, n: int) -> list[tuple[str, dict[str, Any], tuple[int, ...]]]:
    """(op, kwargs, per-rank input shape) for world size ``n``."""
    if name in ("psum", "pmean", "pmax", "pmin"):
        return [(name, {}, (3, 4)), (name, {}, (5,))]
    if name == "all_gather":
        return [
            (name, {"dim": 0}, (3, 4)),
            (name, {"dim": 1}, (3, 4)),
            (name, {"dim": -1, "tiled": False}, (3, 4)),
            (name, {"dim": 0, "tiled": False}, (2, 3)),
        ]
    if name == "psum_scatter":
        return [
            (name, {"dim": 0}, (4, 3)),
            (name, {"dim": -1}, (3, 4)),
            (name, {"dim": 1, "tiled": False}, (3, n)),
            (name, {"dim": 0, "tiled": False}, (n, 2)),
        ]
    if name == "all_to_all":
        return [
            (name, {"split_dim": 0, "concat_dim": 1}, (4, 3)),
            (name, {"split_dim": 1, "concat_dim": 0}, (3, 4)),
            (name, {"split_dim": 1, "concat_dim": 1}, (2, 4)),
            (name, {"split_dim": 2, "concat_dim": 1}, (2, 3, 4)),  # heads <- sequence
        ]
    if name == "ppermute":
        cycle = [(i, (i + 1) % n) for i in range(n)]
        partial = [(0, n - 1)]
        swaps = [(i, i ^ 1) for i in range(n)] if n > 1 else [(0, 0)]
        return [
            (name, {"perm": cycle}, (3, 2)),
            (name, {"perm": partial}, (3, 2)),
            (name, {"perm": swaps}, (4,)),
            (name, {"perm": []}, (2,)),
        ]
    if name == "broadcast":
        return [(name, {"src": 0}, (3, 2)), (name, {"src": n - 1}, (4,))]
    raise AssertionError(name)


OPS = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute")
OPS += ("broadcast",)


def _spmd_op(name: str, kw: dict[str, Any], axis: Any = "x") -> Callable[[Any], Any]:
    fn = getattr(ps, name)
    if name == "ppermute":
        return lambda x: fn(x, axis, kw["perm"])
    return lambda x: fn(x, axis, **kw)


def _ref_op(name: str, kw: dict[str, Any], n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The collective on stacked values: ``X`` of shape ``(n, *local)`` -> ``Y`` ``(n, *out)``."""

    def same(y: torch.Tensor) -> torch.Tensor:  # every rank gets y
        return torch.stack([y] * n)

    if name == "psum":
        return lambda X: same(X.sum(0))
    if name == "pmean":
        return lambda X: same(X.mean(0))
    if name == "pmax":
        return lambda X: same(X.amax(0))
    if name == "pmin":
        return lambda X: same(X.amin(0))
    if name == "all_gather":
        join = torch.cat if kw.get("tiled", True) else torch.stack
        return lambda X: same(join(list(X.unbind(0)), kw["dim"]))
    if name == "psum_scatter":
        if kw.get("tiled", True):
            return lambda X: torch.stack(X.sum(0).chunk(n, kw["dim"]))
        return lambda X: torch.stack(X.sum(0).unbind(kw["dim"]))
    if name == "all_to_all":
        s, c = kw["split_dim"], kw["concat_dim"]
        return lambda X: torch.stack(
            [torch.cat([X[q].chunk(n, s)[r] for q in range(n)], c) for r in range(n)]
        )
    if name == "ppermute":
        src_of = {d: s for s, d in kw["perm"]}
        return lambda X: torch.stack(
            [X[src_of[r]] if r in src_of else torch.zeros_like(X[0]) for r in range(n)]
        )
    if name == "broadcast":
        return lambda X: same(X[kw["src"]])
    raise AssertionError(name)


def _inputs(name: str, kw: dict[str, Any], shape: tuple[int, ...], n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(
        zlib.crc32(repr((name, sorted(kw.items()), shape, n)).encode())
    )

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, dtype=dtype)

    X = rand(n, *shape)
    out = _ref_op(name, kw, n)(X).shape[1:]
    return {
        "X": X,
        "T": rand(n, *shape),
        "C": rand(n, *out),
        "XB": rand(n, B, *shape),
        "CB": rand(n, B, *out),
        "V": rand(n, *shape),
    }


# --- the worker ---------------------------------------------------------------------------------


def _transforms_worker(
    world: int, cases: list, data: list, dtype: torch.dtype, check: bool
) -> list:
    ps.init_mesh({"x": world})
    r = dist.get_rank()
    results = []
    for (name, kw, _), d in zip(cases, data, strict=True):
        op = _spmd_op(name, kw)
        x, c, t, xb, cb, v = (d[k][r] for k in ("X", "C", "T", "XB", "CB", "V"))

        def loss(x: torch.Tensor, c: torch.Tensor, op=op) -> torch.Tensor:
            return (op(x) * c).sum()

        def curved(x: torch.Tensor, c: torch.Tensor = c, op=op) -> torch.Tensor:
            return (c * torch.sin(op(x))).sum()

        out: dict[str, Any] = {"fwd": op(x)}
        out["grad"] = func.grad(loss)(x, c)
        xg = x.clone().requires_grad_()
        loss(xg, c).backward()
        out["backward"] = xg.grad
        out["vjp"] = func.vjp(op, x)[1](c)[0]
        out["jvp_primal"], out["jvp"] = func.jvp(op, (x,), (t,))
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x, t)
            out["fwd_ad"] = torch.autograd.forward_ad.unpack_dual(op(dual)).tangent
        out["vmap"] = func.vmap(op)(xb)
        out["vmap_dim1"] = func.vmap(op, in_dims=1)(xb.movedim(0, 1))
        out["vmap_grad"] = func.vmap(func.grad(loss))(xb, cb)
        out["jacrev"] = func.jacrev(op)(x)
        out["jacfwd"] = func.jacfwd(op)(x)
        out["hessian"] = func.hessian(curved)(x)
        out["grad_grad"] = func.grad(lambda x, v=v: (func.grad(curved)(x) * v).sum())(x)
        xg = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(curved(xg), xg, create_graph=True)
        (gx * v).sum().backward()
        out["backward_double"] = xg.grad
        if check:
            out["gradcheck"] = _gradchecks(op, d["X"], world)
        results.append(out)
    return results


def _gradchecks(op: Callable, X: torch.Tensor, n: int) -> bool:
    """gradcheck/gradgradcheck of ``op`` wrapped shard_map-style: the stacked input is
    replicated, each rank takes its slice (``psum_scatter`` / n), and the outputs are gathered
    back (``all_gather`` / n). In that convention the lockstep finite differences of every rank
    and the analytical Jacobian agree, so torch's checks apply as they are."""

    def wrapped(X: torch.Tensor) -> torch.Tensor:
        x = ps.psum_scatter(X, "x", dim=0, tiled=False) / n
        return ps.all_gather(op(x), "x", dim=0, tiled=False) / n

    # (check_batched_grad would batch with torch's legacy vmap, which custom Functions do not
    # support; torch.func.vmap of gradients is tested above)
    X = X.detach().clone().requires_grad_()
    ok = torch.autograd.gradcheck(wrapped, (X,), check_forward_ad=True, fast_mode=True)
    ok &= torch.autograd.gradgradcheck(wrapped, (X,), check_fwd_over_rev=True, fast_mode=True)
    return ok


# --- references ---------------------------------------------------------------------------------


def _references(name: str, kw: dict[str, Any], n: int, d: dict[str, torch.Tensor]) -> dict:
    Y = _ref_op(name, kw, n)
    X, C, T, XB, CB, V = (d[k] for k in ("X", "C", "T", "XB", "CB", "V"))
    k = X.dim() - 1  # local input dims

    def loss(X: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        return (Y(X) * C).sum()

    def curved(X: torch.Tensor) -> torch.Tensor:
        return (C * torch.sin(Y(X))).sum()

    ref: dict[str, torch.Tensor] = {"fwd": Y(X)}
    ref["grad"] = ref["backward"] = ref["vjp"] = func.grad(loss)(X, C)
    ref["jvp_primal"] = ref["fwd"]
    ref["jvp"] = ref["fwd_ad"] = func.jvp(Y, (X,), (T,))[1]
    ref["vmap"] = ref["vmap_dim1"] = func.vmap(Y, in_dims=1, out_dims=1)(XB)
    ref["vmap_grad"] = func.vmap(func.grad(loss), in_dims=(1, 1), out_dims=1)(XB, CB)
    J = func.jacrev(Y)(X)  # (n, *out, n, *in)
    m = J.dim() - k - 2  # local output dims
    ref["jacrev"] = J.sum(0).movedim(m, 0)  # [r] = sum_s dY_s / dX_r
    ref["jacfwd"] = J.sum(m + 1)  # [r] = sum_s dY_r / dX_s
    H = func.hessian(curved)(X)  # (n, *in, n, *in)
    ref["hessian"] = H.sum(k + 1)
    ref["grad_grad"] = ref["backward_double"] = func.grad(
        lambda X: (func.grad(curved)(X) * V).sum()
    )(X)
    return ref


def _compare(
    name: str, kw: Any, n: int, data: list, got: list[list[dict]], names: Any = None, **tol: Any
) -> None:
    for i, d in enumerate(data):
        op = names[i] if names else name
        ref = _references(op, kw[i] if isinstance(kw, list) else kw, n, d)
        for r in range(n):
            res = got[r][i]
            for key, want in ref.items():
                torch.testing.assert_close(
                    res[key], want[r], **tol, msg=lambda m, key=key, r=r, i=i: (
                        f"{name} case {i} {key} rank {r}: {m}"
                    )
                )  # fmt: skip
            if "gradcheck" in res:
                assert res["gradcheck"] is True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", OPS)
def test_transforms_float64(pool, name: str, world: int) -> None:
    cases = _cases(name, world)
    data = [_inputs(*case, world, torch.float64) for case in cases]
    got = pool.run(world, _transforms_worker, world, cases, data, torch.float64, True)
    _compare(name, [kw for _, kw, _ in cases], world, data, got)


def test_transforms_float32_smoke(pool) -> None:
    world = 2
    cases = [case for name in OPS for case in _cases(name, world)[:1]]
    data = [_inputs(*case, world, torch.float32) for case in cases]
    got = pool.run(world, _transforms_worker, world, cases, data, torch.float32, False)
    for i, (name, kw, _) in enumerate(cases):
        per_rank = [[g[i]] for g in got]
        _compare(name, kw, world, [data[i]], per_rank, rtol=1e-4, atol=1e-4)
        assert per_rank[0][0]["fwd"].dtype == torch.float32


def test_pmax_pmin_ties(pool) -> None:
    """Ties share the gradient and the tangent evenly, as torch.amax/amin do over a dim."""
    world = 4
    X = torch.tensor(
        [[1.0, 0.0, 0.0, 3.0], [1.0, 1.0, 5.0, 3.0], [1.0, 2.0, 5.0, 3.0], [1.0, 3.0, 0.0, 3.0]],
        dtype=torch.float64,
    )
    cases, data = [], []
    for name in ("pmax", "pmin"):
        d = _inputs(name, {}, (4,), world, torch.float64)
        d["X"], d["XB"] = X, torch.stack([X, -X, X.flip(1)], 1)
        cases.append((name, {}, (4,)))
        data.append(d)
    got = pool.run(world, _transforms_worker, world, cases, data, torch.float64, False)
    _compare("pmax/pmin", [{}, {}], world, data, got, names=["pmax", "pmin"])
    # the split itself, spelled out: element 0 is held by all four ranks, element 2 by two
    grad = torch.stack([g[0]["grad"] for g in got])
    C = data[0]["C"]
    torch.testing.assert_close(grad[:, 0], C[:, 0].sum().expand(4) / 4)
    torch.testing.assert_close(grad[:, 2], C[:, 2].sum() * torch.tensor([0, 0.5, 0.5, 0]).double())


# --- pytrees ------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["p", "q"])


@dataclasses.dataclass
class Box:
    u: torch.Tensor
    note: str = dataclasses.field(default="", init=False)


def _tree(T: torch.Tensor, extras: bool = True) -> dict:
    """A nested tree of slices of ``T``; ``extras`` adds what torch.func cannot flatten."""
    tree = {"a": T[0], "b": [T[1:3], (T[3],)], "nt": Pair(T[4], T[5])}
    return {**tree, "none": None, "box": Box(T[6])} if extras else tree


def _pytree_worker(world: int, X: torch.Tensor, C: torch.Tensor) -> dict:
    ps.init_mesh({"x": world})
    r = dist.get_rank()

    def loss(tree: dict) -> torch.Tensor:
        out = ps.all_gather(ps.psum(tree, "x"), "x", dim=-1)
        leaves = zip(pshard_tree.tree_leaves(out), _leaves(C[r], extras=False), strict=True)
        return sum((o * c).sum() for o, c in leaves)

    return {
        "psum": ps.psum(_tree(X[r]), "x"),
        "all_gather": ps.all_gather(_tree(X[r]), "x", dim=-1),
        "grad": func.grad(loss)(_tree(X[r], extras=False)),
        "vmap": func.vmap(lambda t: ps.pmean(t, "x"), in_dims=-1)(_tree(X[r], extras=False)),
    }


def _leaves(T: torch.Tensor, extras: bool = True) -> list[torch.Tensor]:
    return pshard_tree.tree_leaves(_tree(T, extras))


def test_pytree_inputs(pool) -> None:
    world = 2
    g = torch.Generator().manual_seed(1)
    X = torch.randn(world, 7, 3, 2, generator=g, dtype=torch.float64)
    C = torch.randn(world, 7, 3, 2 * world, generator=g, dtype=torch.float64)

    def gathered(X: torch.Tensor) -> torch.Tensor:  # every rank's all_gather(psum(x), dim=-1)
        return torch.cat([X.sum(0)] * world, -1)

    G = func.grad(lambda X: sum((gathered(X) * C[r]).sum() for r in range(world)))(X)
    got = pool.run(world, _pytree_worker, world, X, C)
    for r in range(world):
        res = got[r]
        assert res["psum"]["none"] is None and isinstance(res["psum"]["nt"], Pair)
        assert isinstance(res["all_gather"]["box"], Box)
        assert isinstance(res["grad"]["nt"], Pair) and "none" not in res["grad"]
        want = {
            "psum": _leaves(X.sum(0)),
            "all_gather": _leaves(torch.cat(list(X), -1)),
            "grad": _leaves(G[r], extras=False),
            "vmap": [t.movedim(-1, 0) for t in _leaves(X.mean(0), extras=False)],
        }
        for key, leaves in want.items():
            for out, ref in zip(pshard_tree.tree_leaves(res[key]), leaves, strict=True):
                torch.testing.assert_close(out, ref, msg=lambda m, key=key: f"{key}: {m}")


# --- axes: names, tuples of names, process groups ------------------------------------------------


def _axes_worker() -> dict:
    mesh = ps.init_mesh({"a": 2, "b": 2})
    g = dist.get_rank()  # == 2 * a + b on a row-major mesh
    x = torch.tensor([float(g)], dtype=torch.float64)
    w = torch.arange(4.0, dtype=torch.float64)
    return {
        "index": [ps.axis_index(ax) for ax in ("a", "b", ("a", "b"))],
        "size": [ps.axis_size(ax) for ax in ("a", "b", ("a", "b"), mesh.get_group("b"))],
        "psum_a": ps.psum(x, "a"),
        "psum_b": ps.psum(x, "b"),
        "psum_ab": ps.psum(x, ("a", "b")),
        "gather_a": ps.all_gather(x, "a"),
        "gather_ab": ps.all_gather(x, ("a", "b")),
        "gather_group_b": ps.all_gather(x, mesh.get_group("b")),
        "gather_world": ps.all_gather(x, dist.group.WORLD),
        "grad_ab": func.grad(lambda x: (ps.all_gather(x, ("a", "b")) * w).sum())(x),
        "vmap_grad_group": func.vmap(
            func.grad(lambda x: (ps.all_gather(x, mesh.get_group("a")) * w[:2]).sum())
        )(torch.stack([x, 2 * x])),
        "ppermute_ab": ps.ppermute(x, ("a", "b"), [(i, (i + 1) % 4) for i in range(4)]),
        "broadcast_b": ps.broadcast(x, "b", src=1),
        "pmean_int": ps.pmean(torch.tensor([g]), "a"),
    }


def test_axis_forms(pool) -> None:
    got = pool.run(4, _axes_worker)
    for g, res in enumerate(got):
        a, b = divmod(g, 2)
        f = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        assert res["index"] == [a, b, g]
        assert res["size"] == [2, 2, 4, 2]
        torch.testing.assert_close(res["psum_a"], f(b + (2 + b)))
        torch.testing.assert_close(res["psum_b"], f(2 * a + (2 * a + 1)))
        torch.testing.assert_close(res["psum_ab"], f(6))
        torch.testing.assert_close(res["gather_a"], f(b, 2 + b))
        torch.testing.assert_close(res["gather_ab"], f(0, 1, 2, 3))
        torch.testing.assert_close(res["gather_group_b"], f(2 * a, 2 * a + 1))
        torch.testing.assert_close(res["gather_world"], f(0, 1, 2, 3))
        # every rank's cotangent is w; all_gather's transpose sums them and takes slot g
        torch.testing.assert_close(res["grad_ab"], f(4 * g))
        torch.testing.assert_close(res["vmap_grad_group"], f(2 * a, 2 * a)[:, None])
        torch.testing.assert_close(res["ppermute_ab"], f((g - 1) % 4))
        torch.testing.assert_close(res["broadcast_b"], f(2 * a + 1))
        torch.testing.assert_close(res["pmean_int"], torch.tensor([b + 1.0]))


# --- errors ---------------------------------------------------------------------------------------


def _error_worker() -> dict:
    ps.init_mesh({"x": 2})
    x = torch.zeros(3, 4)
    calls = {
        "unknown_axis": lambda: ps.psum(x, "tp"),
        "dup_dst": lambda: ps.ppermute(x, "x", [(0, 1), (1, 1)]),
        "dup_src": lambda: ps.ppermute(x, "x", [(0, 1), (0, 0)]),
        "perm_range": lambda: ps.ppermute(x, "x", [(0, 2)]),
        "perm_type": lambda: ps.ppermute(x, "x", [0, 1]),
        "split": lambda: ps.all_to_all({"q": [x]}, "x", split_dim=0, concat_dim=1),
        "scatter_tiled": lambda: ps.psum_scatter(x, "x", dim=0),
        "scatter_untiled": lambda: ps.psum_scatter(x, "x", dim=1, tiled=False),
        "dim_range": lambda: ps.all_gather(x, "x", dim=2),
        "leaf": lambda: ps.psum({"a": [x, 1.0]}, "x"),
        "src": lambda: ps.broadcast(x, "x", src=2),
    }
    out = {}
    for key, call in calls.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
        else:
            out[key] = "no error"
    # the group is still in step after all of those
    out["after"] = ps.psum(torch.ones(1), "x")
    return out


def test_error_messages(pool) -> None:
    got = pool.run(2, _error_worker)
    assert got[0] == {**got[1], "after": got[0]["after"]}
    torch.testing.assert_close(got[0]["after"], torch.tensor([2.0]))
    msgs = got[0]
    want = {
        "unknown_axis": "ValueError: psum: axis 'tp' is not in the mesh; its axes are ('x',) "
        "with sizes (2,)",
        "dup_dst": "ValueError: ppermute: perm has rank 1 as dst twice ((0, 1) and (1, 1)); each "
        "rank receives from at most one rank",
        "dup_src": "ValueError: ppermute: perm has rank 0 as src twice ((0, 1) and (0, 0)); each "
        "rank sends to at most one rank",
        "perm_range": "ValueError: ppermute: perm pair (0, 2) names a rank outside axis 'x' of "
        "size 2; ranks are 0..1",
        "perm_type": "TypeError: ppermute: perm must be a list of (src, dst) pairs of ints, got "
        "[0, 1]",
        "split": "ValueError: all_to_all: x['q'][0].shape[0] == 3 (split_dim=0, shape (3, 4)) is "
        "not divisible by the size 2 of axis 'x'; pad dim 0 to a multiple of 2",
        "scatter_tiled": "ValueError: psum_scatter: x.shape[0] == 3 (dim=0, shape (3, 4)) is not "
        "divisible by the size 2 of axis 'x'; pad dim 0 to a multiple of 2",
        "scatter_untiled": "ValueError: psum_scatter: with tiled=False, x.shape[1] must equal the "
        "size 2 of axis 'x', got 4 (shape (3, 4)); use tiled=True to scatter blocks of a longer "
        "dim",
        "dim_range": "ValueError: all_gather: dim=2 is out of range for x with 2 dims (shape "
        "(3, 4)); use dim in [-2, 1]",
        "leaf": "TypeError: psum: x['a'][1] is a float (1.0), not a tensor; collectives take a "
        "tensor or a pytree of tensors (convert it with torch.as_tensor)",
        "src": "ValueError: broadcast: src=2 is not a rank of axis 'x' of size 2; use 0..1",
    }
    for key, text in want.items():
        assert msgs[key] == text, key


def _split_error_worker() -> None:
    ps.init_mesh({"x": 2})
    ps.all_to_all(torch.zeros(2, 3), "x", split_dim=1, concat_dim=0)


def test_error_crosses_the_pool(pool) -> None:
    text = "all_to_all: x.shape[1] == 3 (split_dim=1, shape (2, 3)) is not divisible by the size 2"
    with pytest.raises(ValueError, match=re.escape(text)):
        pool.run(2, _split_error_worker)


# --- one rank: identity, no communication ---------------------------------------------------


def test_world_of_one_is_identity() -> None:
    ps.init_mesh({"sp": 1})
    x = torch.randn(2, 4)
    for y in (
        ps.psum(x, "sp"),
        ps.pmean(x, "sp"),
        ps.pmax(x, "sp"),
        ps.pmin(x, "sp"),
        ps.all_gather(x, "sp", dim=1),
        ps.psum_scatter(x, "sp", dim=1),
        ps.all_to_all(x, "sp", split_dim=1, concat_dim=0),
        ps.ppermute(x, "sp", [(0, 0)]),
        ps.broadcast(x, "sp"),
    ):
        assert y is x
    assert ps.all_gather(x, "sp", dim=-1, tiled=False).shape == (2, 4, 1)
    assert ps.psum_scatter(x[None], "sp", tiled=False).shape == (2, 4)
    assert torch.equal(ps.ppermute(x, "sp", []), torch.zeros(2, 4))
    assert torch.equal(ps.pmean(torch.arange(3), "sp"), torch.arange(3.0))  # a float mean
    assert ps.axis_index("sp") == 0 and ps.axis_size("sp") == 1
    with pytest.raises(ValueError, match=re.escape("pmax: axis 'tp' is not in the mesh")):
        ps.pmax(x, "tp")
    with pytest.raises(ValueError, match=re.escape("ppermute: perm pair (0, 1) names a rank")):
        ps.ppermute(x, "sp", [(0, 1)])


# ------------------------------------------------------------------- tuple axes in any order


def _tuple_order_worker(names: tuple[str, str]) -> dict:
    mesh = ps.init_mesh({"x": 2, "y": 2})
    coord = {n: mesh.get_local_rank(n) for n in ("x", "y")}
    i = ps.axis_index(names)
    v = torch.tensor([float(i)], dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([10.0 * i + j for j in range(4)], dtype=torch.float64)
    gathered = ps.all_gather(v, names)
    (grad,) = torch.autograd.grad((gathered * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), v)
    return {
        "index": (i, coord[names[0]] * 2 + coord[names[1]]),
        "size": ps.axis_size(names),
        "gather": gathered.detach(),
        "gather_grad": grad,
        "psum": ps.psum(v, names).detach(),
        "scatter": ps.psum_scatter(torch.arange(4.0, dtype=torch.float64) * (i + 1), names),
        "a2a": ps.all_to_all(rows, names, split_dim=0, concat_dim=0),
        "ppermute": ps.ppermute(v, names, [(k, (k + 1) % 4) for k in range(4)]).detach(),
        "broadcast": ps.broadcast(v, names, src=1).detach(),
        "pmax": ps.pmax(v * (4 - v), names).detach(),
    }


@pytest.mark.parametrize("names", [("y", "x"), ("x", "y")])
def test_tuple_axes_in_any_order(pool, names) -> None:
    """A tuple of mesh axes is laid out in the order given, the first name major (JAX's
    rule), whatever the mesh's own order: every collective agrees with that index."""
    for res in pool.run(4, _tuple_order_worker, names):
        i, want_index = res["index"]
        assert i == want_index and res["size"] == 4
        f64 = {"dtype": torch.float64}
        torch.testing.assert_close(res["gather"], torch.arange(4.0, **f64))
        torch.testing.assert_close(res["gather_grad"], torch.tensor([4.0 * (i + 1)], **f64))
        torch.testing.assert_close(res["psum"], torch.tensor([6.0], **f64))
        torch.testing.assert_close(res["scatter"], torch.tensor([10.0 * i], **f64))
        torch.testing.assert_close(
            res["a2a"], torch.tensor([10.0 * j + i for j in range(4)], **f64)
        )
        torch.testing.assert_close(res["ppermute"], torch.tensor([float((i - 1) % 4)], **f64))
        torch.testing.assert_close(res["broadcast"], torch.tensor([1.0], **f64))
        torch.testing.assert_close(res["pmax"], torch.tensor([4.0], **f64))


# ------------------------------------------------------------- gloo's large gathers, pairwise


def _pairwise_gather_worker() -> dict:
    from unittest import mock

    from pshard._runtime import wire as _comm

    ps.init_mesh({"x": 2, "y": 2})
    # blocks of the threshold in bytes per rank, then just below it: pairwise, then native
    cols = {
        "large": _comm.PAIRWISE_GATHER_BYTES // 8,
        "small": _comm.PAIRWISE_GATHER_BYTES // 16 - 1,
    }
    calls = {"pairwise": 0, "native": 0}
    native, batch = _comm._all_gather_flat, dist.batch_isend_irecv

    def count(kind: str, fn: Callable) -> Callable:
        def counted(*a: Any, **kw: Any) -> Any:
            calls[kind] += 1
            return fn(*a, **kw)

        return counted

    out: dict = {}
    with (
        mock.patch.object(_comm, "_all_gather_flat", count("native", native)),
        mock.patch.object(dist, "batch_isend_irecv", count("pairwise", batch)),
    ):
        for axis in ("x", ("y", "x"), ("x", "y")):
            i = ps.axis_index(axis)
            for size, n in cols.items():
                x = torch.arange(2 * n, dtype=torch.float64).view(2, n) + 1000.0 * i
                x.requires_grad_(True)
                before = dict(calls)
                y = ps.all_gather(x, axis, dim=1)
                (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
                used = {k: calls[k] - before[k] for k in calls}
                out[(str(axis), size)] = (y.detach(), g, used)
    return out


def test_large_gloo_gathers_go_pairwise(procs) -> None:
    """gloo's all-gathers of 256 KiB per rank and more are pairwise sends and receives, each
    rank's block in its axis slot (reordered tuple axes, sub-groups of a 2x2 mesh), gradients
    through the transpose; smaller ones stay on gloo's own all-gather."""
    for res in procs.run(4, _pairwise_gather_worker):
        for (axis, size), (y, g, used) in res.items():
            k = 2 if axis == "x" else 4
            n = y.shape[1] // k
            base = torch.arange(2 * n, dtype=torch.float64).view(2, n)
            want = torch.cat([base + 1000.0 * j for j in range(k)], dim=1)
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            torch.testing.assert_close(g, torch.full_like(g, float(k)), rtol=0, atol=0)
            kind = "pairwise" if size == "large" else "native"
            assert used[kind] >= 1, (axis, size, used)
            if size == "small":
                assert used["pairwise"] == 0, (axis, used)
            else:
                assert used["native"] == 0, (axis, used)

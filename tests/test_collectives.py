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
import re
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import func

import pshard as ps

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


# --- the worker ------------------------------------------------------------------------------------


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
        out["grad_grad"] = func.grad(lambda x: (func.grad(curved)(x) * v).sum())(x)
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


# --- references ------------------------------------------------------------------------------------


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


def _compare(name: str, kw: dict, n: int, data: list, got: list[list[dict]], **tol: float):
    for i, d in enumerate(data):
        ref = _references(name, kw[i] if isinstance(kw, list) else kw, n, d)
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

"""seq_to_heads / heads_to_seq against single-process concatenation and slicing, gradients
included (rank r's gradient is the derivative of the sum over ranks of sum(out_s * c_s))."""

from __future__ import annotations

import re

import pytest
import torch

import pshard as ps


def _cases(n: int) -> list[tuple[str, tuple[int, ...], dict]]:
    """(op, per-rank input shape, kwargs) for axis size ``n``."""
    s2h, h2s = "seq_to_heads", "heads_to_seq"
    bshd = {"seq_dim": 1, "head_dim": 2}
    bhsd = {"seq_dim": 2, "head_dim": 1}
    return [
        (s2h, (2, 3, 2 * n, 5), bshd),
        (s2h, (2, n, 3, 4), bhsd),
        (s2h, (3, n, 2, 2), {"seq_dim": -2, "head_dim": -3}),
        (s2h, (2, 3, 3 * 2 * n, 4), {**bshd, "num_packed": 3}),
        (s2h, (2, 2 * n, 3, 4), {**bhsd, "num_packed": 2}),
        (s2h, (1, 3, n, 2), {**bshd, "seq_len": 3 * n - 1}),
        (s2h, (1, 2, 3 * n, 2), {**bshd, "num_packed": 3, "seq_len": 2 * n - 1}),
        (h2s, (2, 3 * n, 2, 5), bshd),
        (h2s, (2, 3, 2 * n, 4), bhsd),
        (h2s, (2, 2 * n, 3 * 2, 4), {**bshd, "num_packed": 3}),
        (h2s, (1, 3 * n - 1, 2, 2), {**bshd, "seq_len": 3 * n - 1}),
        (h2s, (1, 2 * n - 1, 3, 2), {**bshd, "num_packed": 3, "seq_len": 2 * n - 1}),
    ]


def _norm(kw: dict, ndim: int) -> tuple[int, int, int, int | None]:
    return kw["seq_dim"] % ndim, kw["head_dim"] % ndim, kw.get("num_packed", 1), kw.get("seq_len")


def _heads_of(t: torch.Tensor, h: int, k: int, r: int, n: int) -> torch.Tensor:
    g = t.unflatten(h, (k, -1))
    per = g.shape[h + 1] // n
    return g.narrow(h + 1, r * per, per).flatten(h, h + 1)


def _reference(op: str, X: list[torch.Tensor], kw: dict) -> list[torch.Tensor]:
    """Every rank's output, computed on one process by concatenating and slicing."""
    n = len(X)
    sd, h, k, seq_len = _norm(kw, X[0].dim())
    if op == "seq_to_heads":
        full = torch.cat(X, sd)
        if seq_len is not None:
            full = full.narrow(sd, 0, seq_len)
        return [_heads_of(full, h, k, r, n) for r in range(n)]
    # heads_to_seq: put the heads back together (per packed group), then cut the sequence
    full = torch.cat([x.unflatten(h, (k, -1)) for x in X], h + 1).flatten(h, h + 1)
    length = full.shape[sd]
    padded = -(-length // n) * n
    if padded != length:
        shape = list(full.shape)
        shape[sd] = padded - length
        full = torch.cat([full, full.new_zeros(shape)], sd)
    return list(full.chunk(n, sd))


def _worker(n: int, X: list, C: list) -> list:
    mesh = ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    out = []
    for (op, _, kw), x, c in zip(_cases(n), X, C, strict=True):
        f = getattr(ps, op)
        x = x[r].clone().requires_grad_(True)
        y = f(x, "sp", **kw)
        (g,) = torch.autograd.grad((y * c[r]).sum(), x)
        gf = torch.func.grad(
            lambda t, f=f, kw=kw, c=c: (f(t, mesh["sp"].get_group(), **kw) * c[r]).sum()
        )(x.detach())
        out.append((y.detach(), g, torch.equal(g, gf)))
    # round trips in both directions
    x = torch.randn(2, 3, 2 * n, 4, dtype=torch.float64)
    back = ps.heads_to_seq(
        ps.seq_to_heads(x, "sp", seq_dim=1, head_dim=2), "sp", seq_dim=1, head_dim=2
    )
    y = torch.randn(2, 3 * n - 1, 3 * 2, 4, dtype=torch.float64)
    kw = {"seq_dim": 1, "head_dim": 2, "num_packed": 3, "seq_len": 3 * n - 1}
    again = ps.seq_to_heads(ps.heads_to_seq(y, "sp", **kw), "sp", **kw)
    return [out, torch.equal(back, x), torch.equal(again, y)]


@pytest.mark.parametrize("n", [2, 4])
def test_against_single_process(pool, n: int) -> None:
    torch.manual_seed(n)
    X, C = [], []
    for op, shape, kw in _cases(n):
        X.append(torch.randn(n, *shape, dtype=torch.float64))
        outs = _reference(op, list(X[-1]), kw)
        C.append(torch.stack([torch.randn_like(o) for o in outs]))
    got = pool.run(n, _worker, n, X, C)
    for r, (cases, round1, round2) in enumerate(got):
        assert round1 and round2
        for i, ((op, _, kw), (y, g, same)) in enumerate(zip(_cases(n), cases, strict=True)):
            Xi = [t.clone().requires_grad_(True) for t in X[i]]
            ref = _reference(op, Xi, kw)
            assert torch.equal(y, ref[r].detach()), (i, r)
            total = sum((o * c).sum() for o, c in zip(ref, C[i], strict=True))
            grads = torch.autograd.grad(total, Xi)
            assert torch.equal(g, grads[r]), (i, r)
            assert same, (i, r)  # torch.func.grad agrees with autograd


def _errors_worker() -> dict:
    ps.init_mesh({"sp": 4})
    out = {}
    x = torch.zeros(2, 3, 6, 4)
    for name, call in {
        "heads": lambda: ps.seq_to_heads(x, "sp", seq_dim=1, head_dim=2),
        "packed": lambda: ps.seq_to_heads(x, "sp", seq_dim=1, head_dim=2, num_packed=4),
        "packed_heads": lambda: ps.seq_to_heads(
            torch.zeros(2, 3, 12, 4), "sp", seq_dim=1, head_dim=2, num_packed=2
        ),
        "same_dim": lambda: ps.seq_to_heads(x, "sp", seq_dim=2, head_dim=-2),
        "range": lambda: ps.heads_to_seq(x, "sp", seq_dim=4, head_dim=2),
        "seq": lambda: ps.heads_to_seq(torch.zeros(2, 6, 1, 4), "sp", seq_dim=1, head_dim=2),
        "seq_len": lambda: ps.heads_to_seq(
            torch.zeros(2, 6, 1, 4), "sp", seq_dim=1, head_dim=2, seq_len=5
        ),
        "too_long": lambda: ps.seq_to_heads(
            torch.zeros(2, 3, 4, 4), "sp", seq_dim=1, head_dim=2, seq_len=13
        ),
    }.items():
        try:
            call()
        except ValueError as e:
            out[name] = str(e)
    return out


def test_errors(pool) -> None:
    got = pool.run(4, _errors_worker)[0]
    assert got["heads"] == (
        "seq_to_heads: x has 6 heads along head_dim=2 (shape (2, 3, 6, 4)), which do not divide "
        "by the size 4 of axis 'sp'; Ulysses gives every rank heads / 4 heads: use a head count "
        "divisible by 4 (or a smaller axis)"
    )
    assert "does not pack num_packed=4 equal groups of heads" in got["packed"]
    assert "x has 6 heads per packed group (2 groups)" in got["packed_heads"]
    assert "seq_dim=2 and head_dim=-2 name the same dim of x" in got["same_dim"]
    assert "seq_dim=4 is out of range for x with 4 dims (shape (2, 3, 6, 4))" in got["range"]
    assert re.search(r"pass seq_len=6 to pad|which do not divide by the size 4", got["seq"])
    assert "seq_len=5 but x has 6 tokens along seq_dim=1" in got["seq_len"]
    assert "seq_len=13 but the gathered sequence has only 12 tokens" in got["too_long"]

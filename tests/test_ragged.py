"""ps.ragged_all_to_all against one process simulating every rank: the rows and counts each
rank receives (uneven, zero, a rank sending nothing), gradients under torch.func.grad, vjp,
jvp and .backward() (the transpose is the reverse exchange), on 2 and 4 ranks (threads; gloo
processes too), and bad counts an error on every rank before any row moves."""

from __future__ import annotations

import re

import pytest
import torch

import pshard as ps

f64 = torch.float64


def _counts(n: int, seed: int) -> list[list[int]]:
    """counts[src][dst]: uneven, with zeros; rank 1 sends nothing at all."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (n, n), generator=g).tolist()
    counts[1] = [0] * n
    return counts


def _rows(src: int, counts: list[int]) -> torch.Tensor:
    """Rank ``src``'s rows: each labelled (src, dst, index) in its first three columns."""
    rows = []
    for dst, k in enumerate(counts):
        for i in range(k):
            rows.append([src, dst, i, src * 0.5 + dst * 0.25 + i])
    return torch.tensor(rows, dtype=f64).reshape(-1, 4)


def _expected(r: int, counts: list[list[int]]) -> torch.Tensor:
    return torch.cat([_rows(s, counts[s])[sum(counts[s][:r]) : sum(counts[s][: r + 1])]
                      for s in range(len(counts))])  # fmt: skip


def rank_exchange(n: int, seed: int):
    ps.init_mesh({"ep": n})
    r = ps.axis_index("ep")
    counts = _counts(n, seed)
    x = _rows(r, counts[r])
    send = torch.tensor(counts[r])
    y, recv = ps.ragged_all_to_all(x, send, "ep")
    ok = torch.equal(y, _expected(r, counts)) and recv.tolist() == [c[r] for c in counts]
    # gradients: each received row weighted by a function of the receiver and the row
    weight = torch.arange(1.0, 5.0, dtype=f64) * (r + 1)

    def loss(x):
        y, _ = ps.ragged_all_to_all(x, send, "ep")
        return ((y * weight) ** 2).sum()

    g = torch.func.grad(loss)(x)
    # the oracle: x's row for dst is weighted by dst's weight
    dst_of = torch.tensor([d for d, k in enumerate(counts[r]) for _ in range(k)], dtype=f64)
    want = 2 * x * (torch.arange(1.0, 5.0, dtype=f64) * (dst_of[:, None] + 1)) ** 2
    xb = x.clone().requires_grad_()
    loss(xb).backward()
    _, pull = torch.func.vjp(lambda x: ps.ragged_all_to_all(x, send, "ep")[0], x)
    (gv,) = pull(torch.ones_like(y))
    _, tangent = torch.func.jvp(lambda x: ps.ragged_all_to_all(x, send, "ep")[0], (x,), (x * 3,))
    return (
        ok,
        torch.allclose(g, want, rtol=1e-14, atol=0),
        torch.allclose(xb.grad, want, rtol=1e-14, atol=0),
        torch.equal(gv, torch.ones_like(x)),
        torch.equal(tangent, y * 3),
        recv.dtype == send.dtype,
    )


@pytest.mark.parametrize("n", [2, 4])
def test_exchange_counts_and_gradients(pool, n):
    for seed in (0, 1):
        for result in pool.run(n, rank_exchange, n, seed):
            assert all(result), result


def test_exchange_on_gloo_processes(procs):
    for result in procs.run(2, rank_exchange, 2, 3):
        assert all(result), result


def rank_bad(case: str):
    ps.init_mesh({"ep": 4})
    r = ps.axis_index("ep")
    x = torch.ones(4, 2)
    send = torch.tensor([1, 1, 1, 1])
    if r == 2:
        send = {"length": torch.tensor([2, 2]), "sum": torch.tensor([1, 1, 1, 0]),
                "negative": torch.tensor([2, 2, 1, -1])}[case]  # fmt: skip
    try:
        ps.ragged_all_to_all(x, send, "ep")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("length", "has 2 entries, but the axis has 4 ranks"),
        ("sum", "sums to 3, but x has 4 rows"),
        ("negative", "has a negative count"),
    ],  # fmt: skip
)
def test_bad_counts_are_an_error_on_every_rank(pool, case, why):
    texts = pool.run(4, rank_bad, case)
    head = "ragged_all_to_all: send_counts are wrong on rank 2 of axis 'ep'"
    for r, text in enumerate(texts):
        assert text is not None and text.startswith(head), (r, text)
    assert f"(here, rank 2: send_counts {why}" in texts[2]
    assert "no rows were sent" in texts[0]
    # the ranks go on: a good exchange after the refused one
    assert pool.run(4, rank_exchange, 4, 5)[0][0]


def test_one_rank_and_bad_input():
    ps.init_mesh({"ep": 1})
    x = torch.ones(3, 2)
    y, counts = ps.ragged_all_to_all(x, torch.tensor([3]), "ep")
    assert y is x and counts.tolist() == [3]
    with pytest.raises(ValueError, match=re.escape("send_counts on rank 0 sums to 2")):
        ps.ragged_all_to_all(x, torch.tensor([2]), "ep")
    with pytest.raises(TypeError, match="ragged_all_to_all: x must be a tensor"):
        ps.ragged_all_to_all([1, 2], torch.tensor([2]), "ep")

"""Ulysses' fused all-to-alls (tokens_to_heads / heads_to_tokens) against a single-process
oracle built from the layout's permutation: every layout, padded lengths, several tensors of
different head counts and sizes in one exchange, other dim orders and batch dims, an axis whose
indices are not its group's ranks; gradients with random cotangents, jvp, vmap, and the round
trip. Also shard_map_seq's entry (take_tokens) against the permuted whole."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

import pshard as ps
from pshard._runtime import wire as _comm
from pshard.sequence import _seq_boundary
from pshard.sequence._exchange import heads_to_tokens, tokens_to_heads
from pshard.sequence._layouts import LAYOUTS, SeqLayout, pad_permute, unpermute_unpad
from pshard.sequence._seq_boundary import take_tokens

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

# (length, dims (sd, hd), per-tensor (heads per rank, head size), batch shape)
CASES = [
    (11, (1, 2), [(2, 3), (1, 3), (1, 5)], (2,)),
    (16, (2, 1), [(1, 4), (3, 2)], (1,)),
    (5, (2, 3), [(1, 2)], (2, 3)),
]


def _canon(x: torch.Tensor, sd: int, hd: int) -> torch.Tensor:
    return x.movedim((hd, sd), (-3, -2))


def _whole(case: tuple, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """Each tensor over the whole sequence, canonical (batch..., heads, seq, size)."""
    s, _, tensors, batch = case
    return [torch.randn(*batch, n * h, s, d, generator=g, dtype=torch.float64) for h, d in tensors]


def _locals(whole: list[torch.Tensor], lay: SeqLayout, sd: int, hd: int, pad: float) -> list:
    """Per rank, its tokens of each tensor in the caller's dim order (padding = ``pad``)."""
    out = []
    for r in range(lay.size):
        mine = []
        for w in whole:
            blocks = pad_permute(w, w.dim() - 2, lay, pad).chunk(lay.size, -2)[r]
            mine.append(blocks.movedim((-3, -2), (hd, sd)).contiguous())
        out.append(mine)
    return out


def _heads(w: torch.Tensor, r: int, n: int) -> torch.Tensor:
    h = w.shape[-3] // n
    return w.narrow(-3, r * h, h)


def _worker(n: int, mesh_shape: dict, axis, cases: list) -> list:
    ps.init_mesh(mesh_shape)
    c = _comm.comm(axis, "test")
    r = c.rank
    out = []
    for kind, case, xs, cts, hs, tans in cases:
        s, (sd, hd), *_ = case
        lay = SeqLayout(kind, s, n)
        x = [t[r].clone().requires_grad_(True) for t in xs]
        y = tokens_to_heads(lay, c, sd, hd, *x)
        grads = torch.autograd.grad(sum((a * b[r]).sum() for a, b in zip(y, cts, strict=True)), x)
        _, jv = torch.func.jvp(
            lambda *a, lay=lay, sd=sd, hd=hd: tokens_to_heads(lay, c, sd, hd, *a),
            tuple(t.detach() for t in x),
            tuple(t[r] for t in tans),
        )
        back = heads_to_tokens(lay, c, sd, hd, *(t[r] for t in hs))
        batched = torch.func.vmap(
            lambda *a, lay=lay, sd=sd, hd=hd: heads_to_tokens(lay, c, sd, hd, *a), in_dims=1
        )(*(torch.stack([t[r], 2 * t[r]], 1) for t in hs))
        round_trip = heads_to_tokens(lay, c, sd, hd, *tokens_to_heads(lay, c, sd, hd, *x))
        out.append(
            (
                [t.detach() for t in y],
                list(grads),
                list(jv),
                list(back),
                list(batched),
                [t.detach() for t in round_trip],
            )
        )
    return [r, out]


@pytest.mark.parametrize(
    "n, mesh_shape, axis",
    [(2, {"sp": 2}, "sp"), (4, {"sp": 4}, "sp"), (4, {"a": 2, "b": 2}, ("b", "a"))],
    ids=["2", "4", "2x2-reordered"],
)
def test_against_single_process(pool, n: int, mesh_shape: dict, axis) -> None:
    g = torch.Generator().manual_seed(n + len(mesh_shape))
    cases, expected = [], []
    for kind in LAYOUTS:
        for case in CASES:
            s, (sd, hd), *_ = case
            lay = SeqLayout(kind, s, n)
            whole = _whole(case, n, g)
            xs = [torch.stack(t) for t in zip(*_locals(whole, lay, sd, hd, 3.0), strict=True)]
            tan_locals = _locals(_whole(case, n, g), lay, sd, hd, 0.0)
            tans = [torch.stack(t) for t in zip(*tan_locals, strict=True)]
            outs = [[_heads(w, r, n) for w in whole] for r in range(n)]
            cts = [torch.randn(n, *o.shape, generator=g, dtype=o.dtype) for o in outs[0]]
            hs = [torch.randn(n, *o.shape, generator=g, dtype=o.dtype) for o in outs[0]]
            cases.append((kind, case, xs, cts, hs, tans))
            expected.append((lay, outs))
    got = dict(pool.run(n, _worker, n, mesh_shape, axis, cases))  # by index on the axis
    for i, ((kind, case, xs, cts, hs, tans), (lay, outs)) in enumerate(
        zip(cases, expected, strict=True)
    ):
        s, (sd, hd), *_ = case
        # the oracle for the gradients: autograd through the single-process composition
        leaves = [[t[r].clone().requires_grad_(True) for t in xs] for r in range(n)]
        whole_again = [
            unpermute_unpad(
                torch.cat([_canon(leaves[r][j], sd, hd) for r in range(n)], -2), -2, lay
            )
            for j in range(len(xs))
        ]
        total = sum(
            (_heads(w, r, n) * cts[j][r]).sum() for r in range(n) for j, w in enumerate(whole_again)
        )
        ref_grads = torch.autograd.grad(total, [t for row in leaves for t in row])
        tan_whole = [
            unpermute_unpad(torch.cat([_canon(t[r], sd, hd) for r in range(n)], -2), -2, lay)
            for t in tans
        ]
        # heads_to_tokens' oracle: put every rank's heads together, pad with zeros, permute
        tokens = _locals([torch.cat([h[r] for r in range(n)], -3) for h in hs], lay, sd, hd, 0.0)
        for r in range(n):
            y, grads, jv, back, batched, round_trip = got[r][i]
            where = (kind, case, r)
            for j, t in enumerate(y):
                assert torch.equal(t, outs[r][j]), where
                assert torch.equal(jv[j], _heads(tan_whole[j], r, n)), where
            for j, gr in enumerate(grads):
                assert torch.equal(gr, ref_grads[r * len(xs) + j]), where
            for j, t in enumerate(back):
                assert torch.equal(t, tokens[r][j]), where
                assert torch.equal(batched[j].select(0, 1), 2 * tokens[r][j]), where
            real = torch.tensor([p < s for p in lay.positions(r)])
            for j, t in enumerate(round_trip):
                keep = real.view([-1 if d == sd else 1 for d in range(t.dim())])
                assert torch.equal(t, torch.where(keep, xs[j][r], 0.0)), where


# ---------------------------------------------- shard_map_seq's entry: this rank's tokens


def _take_worker(n: int, mesh_shape: dict, axis, cases: list, direct: str) -> list:
    ps.init_mesh(mesh_shape)
    c = _comm.comm(axis, "test")
    r = c.rank
    out = []
    # direct: every gather pairwise (as large ones are), so that the gradients' gathers go
    # straight into place wherever the runs are contiguous memory: without a batch before the
    # sequence dim ("unbatched"; these pieces are far below DIRECT_PIECE_BYTES), or with one
    # too ("batched": any piece size); counted
    pairwise = _comm.PAIRWISE_GATHER_BYTES if direct == "no" else 0
    piece = 0 if direct == "batched" else _seq_boundary.DIRECT_PIECE_BYTES
    parts = mock.patch.object(_seq_boundary, "gather_parts", wraps=_seq_boundary.gather_parts)
    with (
        mock.patch.object(_comm, "PAIRWISE_GATHER_BYTES", pairwise),
        mock.patch.object(_seq_boundary, "DIRECT_PIECE_BYTES", piece),
        parts as placed,
    ):
        for case in cases:
            out.append(_take_case(c, n, *case))
    return [r, out, placed.call_count]


def _take_case(c, n: int, kind, s, dim, x, ct, tan) -> tuple:
    lay = SeqLayout(kind, s, n)
    xr = x.clone().requires_grad_(True)
    y = take_tokens(xr, dim, lay, c, 7.0)
    (grad,) = torch.autograd.grad((y * ct[c.rank]).sum(), xr)
    _, jv = torch.func.jvp(lambda a: take_tokens(a, dim, lay, c, 7.0), (x,), (tan,))
    batched = torch.func.vmap(lambda a: take_tokens(a, dim, lay, c, 7.0), in_dims=1)(
        torch.stack([x, 2 * x], 1)
    )
    return y.detach(), grad, jv, batched


@pytest.mark.parametrize(
    "n, mesh_shape, axis",
    [(2, {"sp": 2}, "sp"), (4, {"a": 2, "b": 2}, ("b", "a"))],
    ids=["2", "2x2-reordered"],
)
@pytest.mark.parametrize("direct", ["no", "unbatched", "batched"])
def test_take_tokens_against_permuted_whole(
    procs, n: int, mesh_shape: dict, axis, direct: str
) -> None:
    """shard_map_seq takes each rank's tokens straight from the whole value: the same block as
    padding, permuting and chunking the whole (padding slots = the pad value); the gradient of
    the whole input, the same on every rank, holds every rank's cotangent at its tokens' positions
    (padding dropped), gathered into a buffer and placed, or (direct) each rank's runs of
    consecutive positions (not stripe's) received straight into their positions, row by row
    with a batch before the sequence dim (padded runs, empty runs); jvp with zero padding;
    vmap."""
    g = torch.Generator().manual_seed(n)
    cases = []
    shapes = [(11, 1, (2, 11, 3)), (16, 0, (16, 2)), (5, 2, (2, 3, 5))]
    shapes += [(13, 1, (1, 13, 3)), (5, 1, (1, 5, 2))]
    for kind in LAYOUTS:
        for s, dim, shape in shapes:
            lay = SeqLayout(kind, s, n)
            x = torch.randn(*shape, generator=g, dtype=torch.float64)
            local = list(shape)
            local[dim] = lay.local_length
            ct = torch.randn(n, *local, generator=g, dtype=torch.float64)
            cases.append(
                (kind, s, dim, x, ct, torch.randn(*shape, generator=g, dtype=torch.float64))
            )
    res = procs.run(n, _take_worker, n, mesh_shape, axis, cases, direct)
    got = {r: out for r, out, _ in res}  # by index on the axis
    # one gather per case (the gradient's); straight into place unless stripe, or a batch
    # before the sequence dim when unbatched
    straight = [
        direct == "batched" or direct == "unbatched" and math.prod(x.shape[:dim]) == 1
        for _, _, dim, x, *_ in cases
    ]
    want = sum(go and kind != "stripe" for go, (kind, *_) in zip(straight, cases, strict=True))
    assert {placed for *_, placed in res} == {want}
    for i, (kind, s, dim, x, ct, tan) in enumerate(cases):
        lay = SeqLayout(kind, s, n)
        want_grad = unpermute_unpad(torch.cat(list(ct), dim), dim, lay)
        for r in range(n):
            y, grad, jv, batched = got[r][i]
            where = (kind, s, dim, r)
            assert torch.equal(y, pad_permute(x, dim, lay, 7.0).chunk(n, dim)[r]), where
            assert torch.equal(grad, want_grad), where
            assert torch.equal(jv, pad_permute(tan, dim, lay, 0.0).chunk(n, dim)[r]), where
            for b, scale in enumerate((1, 2)):
                want = pad_permute(scale * x, dim, lay, 7.0).chunk(n, dim)[r]
                assert torch.equal(batched[b], want), where

"""Sequence layouts (pure index math): bijections, exact inverses, padding counts, and the
tensor forms against a hand-built reference for every layout, axis size and length."""

from __future__ import annotations

import re

import pytest
import torch

from pshard.sequence._layouts import (
    LAYOUTS,
    SeqLayout,
    check_layout,
    pad_permute,
    unpermute_unpad,
)
from pshard.sequence._seq_boundary import share_tokens

SIZES = range(1, 6)
LENGTHS = range(14)


def _expected_positions(kind: str, padded: int, n: int, r: int) -> list[int]:
    """Each layout from its definition, written independently of the module."""
    if kind == "contiguous":
        return [t for t in range(padded) if t // (padded // n) == r]
    if kind == "stripe":
        return [t for t in range(padded) if t % n == r]
    chunk = padded // (2 * n)
    return [t for t in range(padded) if t // chunk in (r, 2 * n - 1 - r)]


def test_every_layout_is_a_bijection_with_exact_inverse() -> None:
    checked = 0
    for kind in LAYOUTS:
        multiple = 2 if kind == "zigzag" else 1
        for n in SIZES:
            for s in LENGTHS:
                lay = SeqLayout(kind, s, n)
                p = lay.padded_length
                assert p % (multiple * n) == 0 and s <= p < s + multiple * n
                assert lay.num_pad == p - s and lay.local_length * n == p
                perm, inv = lay.permutation(), lay.inverse()
                assert sorted(perm) == list(range(p))  # a bijection of the padded positions
                assert all(inv[perm[i]] == i for i in range(p))
                assert all(perm[inv[q]] == q for q in range(p))
                for r in range(n):
                    pos = lay.positions(r)
                    assert list(pos) == _expected_positions(kind, p, n, r)
                    assert len(pos) == lay.local_length
                    assert list(pos) == sorted(pos)  # ascending on each rank
                    assert perm[r * lay.local_length : (r + 1) * lay.local_length] == pos
                    assert lay.is_pad(r) == tuple(q >= s for q in pos)
                    assert lay.position_tensor(r).tolist() == list(pos)
                assert sum(sum(lay.is_pad(r)) for r in range(n)) == lay.num_pad
                assert lay.position_tensor().tolist() == list(perm)
                checked += 1
    assert checked == 3 * 5 * 14


def test_padding_counts() -> None:
    assert SeqLayout("contiguous", 13, 4).num_pad == 3
    assert SeqLayout("stripe", 13, 4).num_pad == 3
    assert SeqLayout("zigzag", 13, 4).num_pad == 3  # 16 = 2 * 4 * 2
    assert SeqLayout("zigzag", 9, 4).num_pad == 7
    assert SeqLayout("contiguous", 12, 4).num_pad == 0
    assert SeqLayout("zigzag", 0, 3).padded_length == 0
    assert SeqLayout("contiguous", 1, 5).is_pad(0) == (False,)
    assert SeqLayout("contiguous", 1, 5).is_pad(4) == (True,)


def test_zigzag_balances_causal_work() -> None:
    # each rank's causal attention work (sum of (position + 1)) is the same
    lay = SeqLayout("zigzag", 16, 4)
    work = {sum(p + 1 for p in lay.positions(r)) for r in range(4)}
    assert len(work) == 1


def test_tensor_forms_round_trip_with_gradients() -> None:
    for kind in LAYOUTS:
        for n in SIZES:
            for s in LENGTHS:
                lay = SeqLayout(kind, s, n)
                x = torch.randn(2, s, 3, dtype=torch.float64, requires_grad=True)
                y = pad_permute(x, 1, lay, value=7.0)
                assert y.shape == (2, lay.padded_length, 3)
                perm = lay.permutation()
                for slot, q in enumerate(perm):
                    want = x[:, q] if q < s else torch.full((2, 3), 7.0, dtype=x.dtype)
                    assert torch.equal(y[:, slot], want)
                back = unpermute_unpad(y, 1, lay)
                assert torch.equal(back, x)
                (g,) = torch.autograd.grad(back, x, torch.ones_like(back))
                assert torch.equal(g, torch.ones_like(x))
                ids = torch.arange(s)
                assert unpermute_unpad(pad_permute(ids, 0, lay, -100), 0, lay).tolist() == list(
                    range(s)
                )
                mask = torch.ones(s, dtype=torch.bool)
                assert pad_permute(mask, 0, lay, False).sum().item() == s


def test_tensor_forms_under_vmap() -> None:
    lay = SeqLayout("zigzag", 5, 2)
    x = torch.randn(3, 5, 2)
    y = torch.func.vmap(lambda t: pad_permute(t, 0, lay, 0.0))(x)
    assert torch.equal(y, pad_permute(x, 1, lay, 0.0))
    assert torch.equal(torch.func.vmap(lambda t: unpermute_unpad(t, 0, lay))(y), x)


def _oracle(kind: str, s: int, n: int):
    """pad_permute / unpermute_unpad written with index_select on the layout's permutation."""
    lay = SeqLayout(kind, s, n)
    perm = torch.tensor(lay.permutation())
    inv = torch.tensor(lay.inverse()[:s], dtype=torch.int64)

    def forward(x, dim, value):
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, lay.num_pad]
        return torch.nn.functional.pad(x, pad, value=value).index_select(dim, perm)

    return lay, forward, lambda y, dim: y.index_select(dim, inv)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_tensor_forms_transforms_against_index_select(kind: str) -> None:
    """vjp with random cotangents, jvp, vmap over a middle dim, second derivatives and strided
    inputs, each equal to the index_select form."""
    torch.manual_seed(0)
    for n, s in ((2, 7), (3, 12), (4, 9)):
        _check_transforms(kind, n, s)


def _check_transforms(kind: str, n: int, s: int) -> None:
    lay, ref_f, ref_b = _oracle(kind, s, n)
    x = torch.randn(3, 2, s, dtype=torch.float64).transpose(0, 2)  # (s, 2, 3), strided
    out, vjp = torch.func.vjp(lambda t: pad_permute(t, 0, lay, 0.5), x)
    ref, ref_vjp = torch.func.vjp(lambda t: ref_f(t, 0, 0.5), x)
    assert torch.equal(out, ref)
    ct = torch.randn_like(out)
    assert torch.equal(vjp(ct)[0], ref_vjp(ct)[0])
    t = torch.randn_like(x)
    assert torch.equal(
        torch.func.jvp(lambda u: pad_permute(u, 0, lay, 0.5), (x,), (t,))[1],
        ref_f(t, 0, 0.0),
    )
    y = torch.randn(2, lay.padded_length, 4, dtype=torch.float64)
    back, vjp = torch.func.vjp(lambda u: unpermute_unpad(u, 1, lay), y)
    assert torch.equal(back, ref_b(y, 1))
    ct = torch.randn_like(back)
    assert torch.equal(vjp(ct)[0], ref_f(ct, 1, 0.0))
    assert torch.equal(
        torch.func.jvp(lambda u: unpermute_unpad(u, 1, lay), (y,), (y,))[1], ref_b(y, 1)
    )
    # vmap over dim 1 of (s, batch, 3): the sequence stays dim 0 inside
    got = torch.func.vmap(lambda u: pad_permute(u, 0, lay, 0.5), in_dims=1)(x)
    assert torch.equal(got, ref_f(x, 0, 0.5).movedim(1, 0))
    got = torch.func.vmap(lambda u: unpermute_unpad(u, 0, lay), in_dims=1)(y.transpose(0, 1))
    assert torch.equal(got, ref_b(y, 1))
    # second order: the Hessian of a cubic through both forms
    w = torch.randn(lay.padded_length, 2, 3, dtype=torch.float64)

    def cubic(u, f=pad_permute, lay=lay, w=w):
        return (f(u, 0, lay, 0.5) ** 3 * w).sum()

    h = torch.func.hessian(cubic)(x[:, 0, 0].contiguous().unsqueeze(1).unsqueeze(2))
    h_ref = torch.func.hessian(lambda u, w=w: (ref_f(u, 0, 0.5) ** 3 * w).sum())(
        x[:, 0, 0].contiguous().unsqueeze(1).unsqueeze(2)
    )
    assert torch.allclose(h, h_ref, rtol=0, atol=1e-12)


def test_errors() -> None:
    with pytest.raises(ValueError, match=re.escape("f: layout must be one of 'contiguous',")):
        check_layout("ring", "f")
    with pytest.raises(ValueError, match=re.escape("SeqLayout: size must be >= 1, got 0")):
        SeqLayout("stripe", 3, 0)
    with pytest.raises(TypeError, match=re.escape("SeqLayout: length must be an int")):
        SeqLayout("stripe", 3.0, 2)
    with pytest.raises(ValueError, match=re.escape("SeqLayout: rank 2 is out of range")):
        SeqLayout("stripe", 3, 2).positions(2)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_hooks_share_split_against_the_permuted_whole(kind: str) -> None:
    """The hooks' split: rank r's tokens of the whole value straight from it, the same as
    padding, permuting and chunking; its transpose puts the cotangent at r's positions, zeros
    elsewhere (r's share), and is linear again (double backward), with jvp and vmap."""
    g = torch.Generator().manual_seed(0)
    for n, s, dim, shape in ((2, 11, 1, (2, 11, 3)), (4, 7, 0, (7, 2)), (3, 5, 2, (2, 3, 5))):
        lay = SeqLayout(kind, s, n)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        for r in range(n):
            want = pad_permute(x, dim, lay, 5.0).chunk(n, dim)[r]
            xr = x.clone().requires_grad_(True)
            y = share_tokens(xr, dim, lay, r, 5.0)
            assert torch.equal(y, want)
            ct = torch.randn(y.shape, generator=g, dtype=torch.float64, requires_grad=True)
            (grad,) = torch.autograd.grad((y * ct).sum(), xr, create_graph=True)
            blocks = [ct.detach() if i == r else torch.zeros_like(ct) for i in range(n)]
            assert torch.equal(grad, unpermute_unpad(torch.cat(blocks, dim), dim, lay))
            w = torch.randn(grad.shape, generator=g, dtype=torch.float64)
            (again,) = torch.autograd.grad((grad * w).sum(), ct)  # d/d ct of <share(ct), w>
            assert torch.equal(again, pad_permute(w, dim, lay, 0.0).chunk(n, dim)[r])
            tan = torch.randn(*shape, generator=g, dtype=torch.float64)
            _, jv = torch.func.jvp(
                lambda a, r=r, d=dim, lay=lay: share_tokens(a, d, lay, r, 5.0), (x,), (tan,)
            )
            assert torch.equal(jv, pad_permute(tan, dim, lay, 0.0).chunk(n, dim)[r])
            batched = torch.func.vmap(
                lambda a, r=r, d=dim, lay=lay: share_tokens(a, d, lay, r, 5.0)
            )(torch.stack([x, 2 * x]))
            assert torch.equal(batched[1], pad_permute(2 * x, dim, lay, 5.0).chunk(n, dim)[r])

"""ring_attention against single-process attention over the whole sequence (float64, forward
and gradients through .backward() and torch.func.grad) on 1, 2 and 4 ranks, under every layout,
lengths not divisible by the axis size, GQA, causal or not; float32 against float64; the tiny
LM of the Ulysses tests with ring_attention against the single-process model (also under
pmap_microbatch); the skipped-block schedule per layout; saved activations; pinned errors."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import full_attention, seq_block, spied, spy
from test_seq_model import (
    BATCH_SPECS,
    PADS,
    _assert_tree_close,
    init_params,
    local_loss,
    make_batch,
    microbatched_against_reference,
    ref_loss,
)

import pshard as ps
from pshard._core.tree import tree_map
from pshard.sequence import _kernels as kernels
from pshard.sequence import _ring_blocks as blocks
from pshard.sequence import _ring_pass as ring_pass
from pshard.sequence import _ring_schedule as schedule
from pshard.sequence._context import SeqContext, sequence_context
from pshard.sequence._layouts import LAYOUTS, SeqLayout, pad_permute
from pshard.sequence._ring_schedule import BlockCounts, block_counts

B, D = 2, 3
TOL = {"rtol": 1e-9, "atol": 1e-11}

# torch.func.jvp scripts its decompositions on first use, which warns on torch 2.13
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _configs(n: int) -> list[tuple[str, int, int, int, bool]]:
    """(layout, seq_len, query heads, kv heads, causal)."""
    out = []
    for kind in LAYOUTS:
        for s in (2 * n + 1, 4 * n, max(n - 1, 1)):
            for hq, hkv in ((2, 2), (4, 1)):
                for causal in (False, True):
                    out.append((kind, s, hq, hkv, causal))
    return out


def _data(n: int, dtype=torch.float64) -> list:
    torch.manual_seed(n)
    data = []
    for _, s, hq, hkv, _ in _configs(n):
        q = torch.randn(B, s, hq, D, dtype=dtype)
        k = torch.randn(B, s, hkv, D, dtype=dtype)
        v = torch.randn(B, s, hkv, D + 1, dtype=dtype)  # another head size for v
        c = torch.randn(B, s, hq, D + 1, dtype=dtype)
        data.append((q, k, v, c))
    return data


def _weighted(q, k, v, cot, causal):
    return (ps.ring_attention(q, k, v, causal=causal) * cot).sum()


def _worker(n: int, data: list) -> list:
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    out = []
    for (kind, s, _, _, causal), (q, k, v, c) in zip(_configs(n), data, strict=True):
        lay = SeqLayout(kind, s, n)
        local = [seq_block(t, lay, r).requires_grad_(True) for t in (q, k, v)]
        cot = seq_block(c, lay, r)
        with sequence_context(SeqContext(("sp",), lay, r, torch.device("cpu"))):
            y = ps.ring_attention(*local, axis="sp", causal=causal)
            grads = torch.autograd.grad((y * cot).sum(), local)

            fgrads = torch.func.grad(_weighted, argnums=(0, 1, 2))(
                *(t.detach() for t in local), cot, causal
            )
        out.append((y.detach(), grads, fgrads))
    return out


def _check(n: int, data: list, got: list, tol: dict) -> None:
    for i, ((kind, s, hq, hkv, causal), (q, k, v, c)) in enumerate(
        zip(_configs(n), data, strict=True)
    ):
        lay = SeqLayout(kind, s, n)
        inputs = [t.to(torch.float64).requires_grad_(True) for t in (q, k, v)]
        ref = full_attention(*inputs, causal)
        ref_grads = torch.autograd.grad((ref * c.to(torch.float64)).sum(), inputs)
        for r in range(n):
            y, grads, fgrads = got[r][i]
            msg = f"rank {r} config {(kind, s, hq, hkv, causal)}"
            assert y.dtype == q.dtype, msg
            want = seq_block(ref.detach(), lay, r).to(q.dtype)
            real = torch.tensor(lay.is_pad(r)).logical_not().view(1, -1, 1, 1)
            torch.testing.assert_close(y, want * real, msg=msg, **tol)  # padding rows are 0
            for g, fg, rg in zip(grads, fgrads, ref_grads, strict=True):
                torch.testing.assert_close(g, seq_block(rg, lay, r).to(q.dtype), msg=msg, **tol)
                torch.testing.assert_close(fg, g, msg=msg, **tol)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_against_full_attention(pool, n: int) -> None:
    data = _data(n)
    _check(n, data, pool.run(n, _worker, n, data), TOL)


_LEAF = blocks._LEAF


def _cut_worker(n: int, data: list) -> list:
    blocks._LEAF = 1  # every triangle of 2 rows or more is cut in halves, down to 1 row
    try:
        return _worker(n, data)
    finally:
        blocks._LEAF = _LEAF


@pytest.mark.parametrize("n", [2, 4])
def test_against_full_attention_cut_in_halves(pool, n: int) -> None:
    """The same cases with every causal block cut in halves down to single rows (long blocks'
    path, here on short ones): forward and both gradients still equal full attention, under
    every layout, padding, grouped heads and another head size for v."""
    data = _data(n)
    _check(n, data, pool.run(n, _cut_worker, n, data), TOL)


def test_float32_relative_error(pool) -> None:
    """float32 inputs against the float64 reference: relative error <= 1e-5."""
    n = 4
    data = _data(n, torch.float32)
    _check(n, data, pool.run(n, _worker, n, data), {"rtol": 1e-5, "atol": 1e-6})


# --------------------------------------------------------------------------- layout, dims


def _outside_worker(n: int, q, k, v) -> dict:
    """Outside shard_map_seq: contiguous, unpadded; other seq/head dims; a scale."""
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    mine = [t.chunk(n, 1)[r] for t in (q, k, v)]
    plain = ps.ring_attention(*mine, causal=True)
    moved = ps.ring_attention(
        *(t.permute(2, 0, 1, 3) for t in mine), seq_dim=2, head_dim=0, causal=True, scale=0.3
    )
    return {"plain": plain, "moved": moved.permute(1, 2, 0, 3)}


def test_outside_shard_map_seq_and_dims(pool) -> None:
    n = 2
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 6, 4, D, dtype=torch.float64) for _ in range(3))
    got = pool.run(n, _outside_worker, n, q, k, v)
    ref = full_attention(q, k, v, True)
    scaled = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=0.3
    ).transpose(1, 2)
    for r in range(n):
        torch.testing.assert_close(got[r]["plain"], ref.chunk(n, 1)[r], **TOL)
        torch.testing.assert_close(got[r]["moved"], scaled.chunk(n, 1)[r], **TOL)


# --------------------------------------------------------------------------- the tiny LM


def _ring(q, k, v):
    return ps.ring_attention(q, k, v, axis="sp", causal=True)


def _lm_configs(n: int) -> list[tuple[str, int, int, int]]:
    return [
        (kind, s, hq, hkv)
        for kind in LAYOUTS
        for s, (hq, hkv) in ((2 * n + 3, (4, 4)), (n + 1, (4, 1)), (3 * n, (4, 2)))
    ]


def _model_worker(n: int) -> list:
    ps.init_mesh({"sp": n})
    out = []
    for i, (kind, s, hq, hkv) in enumerate(_lm_configs(n)):
        params = init_params(hq, hkv, seed=i)
        batch = make_batch(2, s, seed=100 + i)
        loss = ps.shard_map_seq(
            functools.partial(local_loss, attention=_ring),
            in_specs=(None, BATCH_SPECS),
            out_specs=ps.Replicate(),
            layout=kind,
            pad_values=(0, PADS),
        )
        ref_grad, ref_value = torch.func.grad_and_value(ref_loss)(params, batch)
        grad, value = torch.func.grad_and_value(loss)(params, batch)
        leaves = tree_map(lambda t: t.detach().requires_grad_(True), params)
        loss(leaves, batch).backward()
        out.append(
            {
                "value": (value, ref_value),
                "grad": (grad, ref_grad),
                "backward": tree_map(lambda t: t.grad, leaves),
            }
        )
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_model_matches_single_process(pool, n: int) -> None:
    results = pool.run(n, _model_worker, n, timeout=300)
    for r, per_rank in enumerate(results):
        for config, res in zip(_lm_configs(n), per_rank, strict=True):
            msg = f"rank {r} {config}"
            torch.testing.assert_close(*res["value"], msg=msg, **TOL)
            _assert_tree_close(*res["grad"], msg=msg)
            _assert_tree_close(res["backward"], res["grad"][1], msg=msg)


def _microbatch_worker(n: int) -> dict:
    """pmap_microbatch(grad_and_value(shard_map_seq(...))) with token weights equals the
    whole batch; an empty sequence gives loss 0 and zero gradients."""
    ps.init_mesh({"sp": n})
    params, batch = init_params(4, 2, seed=3), make_batch(4, 2 * n + 1, seed=7)
    return microbatched_against_reference(_ring, params, batch)


def test_pmap_microbatch_around(pool) -> None:
    for res in pool.run(2, _microbatch_worker, 2):
        _assert_tree_close(*res["grad"], msg="pmap_microbatch")
        torch.testing.assert_close(*res["value"], **TOL)
        value, grad = res["empty"]
        assert value.item() == 0.0
        _assert_tree_close(grad, tree_map(torch.zeros_like, grad), msg="empty sequence")


# --------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_block_counts(n: int) -> None:
    s = 16 * n
    zig = block_counts("zigzag", s, n, causal=True)
    assert max(c.work for c in zig) <= 1.1 * min(c.work for c in zig)
    assert {c.work for c in zig} == {2.0 * n}  # half of the 4 n^2 chunk pairs, over n ranks
    contig = block_counts("contiguous", s, n, causal=True)
    assert [c.work for c in contig] == [4.0 * r + 2 for r in range(n)]
    assert contig[-1].work / contig[0].work == 2 * n - 1
    stripe = block_counts("stripe", s, n, causal=True)
    assert len({c.work for c in stripe}) == 1
    for kind in LAYOUTS:  # nothing skipped without a mask, one chunk per rank
        assert block_counts(kind, s, n, causal=False) == (BlockCounts(n, 0, 0),) * n
        total = sum(c.work for c in block_counts(kind, s, n, causal=True))
        assert total == 2 * n * n  # causal attention is half the 4 n^2 pairs
    padded = block_counts("zigzag", 4 * n - 3, n, causal=False)  # a padded, unmasked layout
    assert all(c.partial for c in padded) or n == 1


def count_worker(n: int, s: int, kind: str, seg: torch.Tensor | None = None) -> int:
    """Blocks the kernel actually computes, counted in query rows x key rows (with the whole
    sequence's segment ids ``seg``, ``(1, s)``, when given); run under :func:`counting_rows`."""
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    lay = SeqLayout(kind, s, n)
    q = torch.randn(1, lay.local_length, 1, 2)
    mine = None if seg is None else pad_permute(seg, 1, lay, -1).chunk(n, 1)[r]
    rows = spied([0])
    with sequence_context(SeqContext(("sp",), lay, r, torch.device("cpu"))):
        ps.ring_attention(q, q, q, causal=True, segment_ids=mine)
    return rows[0]


def _add_rows(rows: list[int], qa: torch.Tensor, kb: torch.Tensor, *args: object) -> None:
    rows[0] += qa.shape[-2] * kb.shape[-2]  # one head: query rows x key rows of the block


def counting_rows():
    """The ring's block computations counted per rank (:func:`count_worker`)."""
    return spy(ring_pass, "block_forward", _add_rows)


def test_kernel_skips_masked_blocks(pool) -> None:
    n, s = 4, 32
    for kind in LAYOUTS:
        with counting_rows():
            rows = pool.run(n, count_worker, n, s, kind)
        chunk = s // n // 2
        want = [(c.full + c.partial) * chunk * chunk for c in block_counts(kind, s, n, True)]
        assert rows == want, kind


def triangle_worker(n: int, s: int, kind: str, hkv: int) -> list[int]:
    """How many blocks ran with the fused kernels' own causal flag (no mask built): lower
    triangles, strict lower triangles; run under a spy of the ring's block computation."""
    ps.init_mesh({"sp": n})
    r = ps.axis_index("sp")
    lay = SeqLayout(kind, s, n)
    q, k = torch.randn(1, lay.local_length, 2, 4), torch.randn(1, lay.local_length, hkv, 4)
    flagged = spied([0, 0])
    with sequence_context(SeqContext(("sp",), lay, r, torch.device("cpu"))):
        ps.ring_attention(q, k, k, causal=True)
    return flagged


def _add_flag(flagged: list[int], *args: object) -> None:
    if args[-1] is not None:
        flagged[args[-1]] += 1  # type: ignore[index]


def test_triangular_blocks_use_the_kernels_causal_flag(pool) -> None:
    """Each rank's chunks against themselves (zigzag, contiguous: 2 per rank) go to the kernel
    as plain causal blocks, and so do stripe chunks against an earlier rank's (the lower
    triangle) and a later rank's (the strict one: rows 1: against keys :-1), grouped query heads
    too; padded keys keep the explicit mask (exactness of every path:
    test_against_full_attention, test_triangle_blocks_cut_in_halves_are_exact)."""
    n = 2
    with spy(ring_pass, "block_forward", _add_flag):
        _triangles(pool, n)


def _triangles(pool, n: int) -> None:
    for hkv in (2, 1):  # 2 query heads: one per key/value head, or both on one
        for kind in ("zigzag", "contiguous"):
            assert pool.run(n, triangle_worker, n, 16, kind, hkv) == [[2, 0], [2, 0]], kind
        # stripe: rank 0 sees rank 1's chunks strictly below the diagonal, rank 1 sees rank 0's
        # on and below it
        assert pool.run(n, triangle_worker, n, 16, "stripe", hkv) == [[2, 2], [4, 0]]
    assert pool.run(n, triangle_worker, n, 15, "zigzag", 2) == [[1, 0], [2, 0]]  # rank 0: pad


def test_triangles_found_from_positions_match_the_mask() -> None:
    """Which blocks are (strict) lower triangles, read off the positions in linear time, agrees
    with building each block's mask, for every layout, rank pair and chunk pair, with padding."""
    from pshard.sequence._masks import position_mask

    found = set()
    for kind in LAYOUTS:
        for n, s in ((2, 16), (2, 15), (3, 20), (4, 32), (4, 29)):
            lay = SeqLayout(kind, s, n)
            b = schedule.chunk_bounds(lay.local_length, 2)
            for r in range(n):
                for src in range(n):
                    for q in range(2):
                        for k in range(2):
                            got = schedule.triangle_of(lay, r, src, b[q], b[q + 1], b[k], b[k + 1])
                            qp = torch.tensor(lay.positions(r)[b[q] : b[q + 1]])
                            kp = torch.tensor(lay.positions(src)[b[k] : b[k + 1]])
                            seen = position_mask(qp, kp, s, True, None)
                            want = None
                            if seen.shape[0] == seen.shape[1] >= 2:
                                lower = torch.ones(seen.shape, dtype=torch.bool).tril()
                                for offset in (0, 1):
                                    if want is None and torch.equal(seen, lower.tril(-offset)):
                                        want = offset
                            assert got == want, (kind, n, s, r, src, q, k)
                            found.add(got)
    assert found == {None, 0, 1}


@pytest.mark.parametrize("rows,groups", [(129, 1), (300, 1), (129, 3)])
@pytest.mark.parametrize("tri", [0, 1])
def test_triangle_blocks_cut_in_halves_are_exact(tri: int, rows: int, groups: int) -> None:
    """A lower-triangle block (strict with ``tri=1``) longer than the kernel's leaf is computed
    in halves and merged, grouped query heads unfolded into heads: output, log-sum-exp and the
    three gradients equal the block with the explicit mask (float64, from the whole softmax's
    output and log-sum-exp, as the ring gives them)."""
    g = torch.Generator().manual_seed(rows + tri + groups)
    f64 = {"generator": g, "dtype": torch.float64}
    kb, vb = (torch.randn(2, 3, rows, 8, **f64) for _ in range(2))
    # each key/value head's query heads folded into its rows, group-major
    qa, do = (torch.randn(2, 3, groups * rows, 8, **f64) for _ in range(2))
    spec = schedule.RingSpec(None, True, 0.3, groups)
    acc = torch.float64
    mask = torch.ones(rows, rows, dtype=torch.bool).tril(-tri)
    assert rows > blocks._LEAF  # cut at least once
    kern = kernels.CPU
    out, lse = blocks.block_forward(qa, kb, vb, mask, spec, acc, kern, tri)
    want_out, want_lse = blocks.block_forward(qa, kb, vb, mask, spec, acc, kern, None)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    q, k, v = (t.clone().requires_grad_() for t in (qa, kb, vb))
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask.repeat(groups, 1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num()  # the strict triangle's row 0 sees nothing: zeros
    torch.testing.assert_close(p @ v, out, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(p @ v, (q, k, v), do)
    finite = torch.where(lse.isneginf(), torch.zeros_like(lse), lse)
    delta = (do * out).sum(-1)
    got = blocks.block_backward(qa, kb, vb, do, out, finite, delta, mask, spec, acc, kern, tri)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- memory, errors


def test_saves_only_inputs_output_and_lse() -> None:
    ps.init_mesh({"sp": 1})
    q, k, v = (torch.randn(2, 64, 4, 8, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = ps.ring_attention(q, k, v, causal=True)
    # q, k, v, out (2 * 64 * 4 * 8 each) and lse (2 * 4 * 64): no s x s tensor
    assert sorted(t.numel() for t in saved) == [512] + [4096] * 4
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_errors() -> None:
    ps.init_mesh({"sp": 1})
    q = torch.randn(1, 4, 3, 2)
    with pytest.raises(
        ValueError, match=re.escape("ring_attention: q has 3 heads and k, v have 2")
    ):
        ps.ring_attention(q, torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2))
    with pytest.raises(
        TypeError, match=re.escape("ring_attention: q, k, v must have one floating")
    ):
        ps.ring_attention(q, q.double(), q)
    with pytest.raises(ValueError, match=re.escape("ring_attention: seq_dim=3 names the last dim")):
        ps.ring_attention(q, q, q, seq_dim=3)
    with pytest.raises(ValueError, match=re.escape("ring_attention: seq_dim=4 is out of range")):
        ps.ring_attention(q, q, q, seq_dim=4)
    with pytest.raises(NotImplementedError, match=re.escape("ring_attention: torch.func.vmap")):
        torch.func.vmap(lambda x: ps.ring_attention(x, x, x))(q.unsqueeze(0))
    with pytest.raises(NotImplementedError, match=re.escape("ring_attention: forward-mode")):
        torch.func.jvp(lambda x: ps.ring_attention(x, x, x), (q,), (q,))
    x = q.double().requires_grad_(True)
    with pytest.raises(NotImplementedError, match=re.escape("ring_attention: higher-order")):
        torch.func.grad(lambda x: torch.func.grad(_weighted)(x, x, x, x, True).sum())(x)
    (g,) = torch.autograd.grad(_weighted(x, x, x, x, True), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=re.escape("ring_attention: higher-order")):
        g.sum().backward()
    lay = SeqLayout("zigzag", 5, 1)
    with sequence_context(SeqContext(("sp",), lay, 0, torch.device("cpu"))):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "ring_attention: q has 4 tokens along seq_dim=1 (shape (1, 4, 3, 2)) but "
                "shard_map_seq gave this rank 6 (a sequence of 5 on 1 ranks, zigzag layout)"
            ),
        ):
            ps.ring_attention(q, q, q)


def test_strided_inputs() -> None:
    """q, k, v that are views with a non-unit last stride (unbind of a packed last dim), as the
    fused CPU kernel does not read them correctly unless made contiguous first."""
    ps.init_mesh({"sp": 1})
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 4, 3, 3, dtype=torch.float64).unbind(-1)
    assert q.stride(-1) != 1
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ps.ring_attention(*x, causal=True, window=3)
    mask = torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-3)
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, **TOL)
    (out * ref).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x)

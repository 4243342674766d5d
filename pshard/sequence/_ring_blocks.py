"""One block of ring attention and the online softmax merge of partial results.

A block is one query chunk against one key chunk (:mod:`._ring_schedule` decides which blocks
run and with which mask). :func:`block_forward` gives its output, normalised by its own softmax,
and its log-sum-exp; :func:`merge` combines two such partial results of the same query rows
into the result over both sets of keys, exactly (the running log-sum-exp is kept in fp32, or
the input dtype when wider: :func:`acc_dtype`). :func:`block_backward` gives the block's
``(dq, dk, dv)`` from the *whole* softmax's output rows and log-sum-exp, so every block's
gradient is exact without the merge being differentiated.

A block runs on a fused kernel when the device has one (:mod:`._kernels`: the CPU flash
kernel, CUDA efficient attention in float32), else on explicit matmuls. Query heads share their
key/value head: the ``g`` query heads of a key/value head are folded into the rows of one
matrix (:func:`fold`), so grouped-query attention needs no copies of K/V, except for the fused
kernels' causal flag, which wants one head per query head. Causal triangles on the CPU kernel
are cut in halves (the kernel skips only masked tiles of its own size).
"""

from __future__ import annotations

import math

import torch

from ._kernels import BlockKernel, additive, finite
from ._ring_schedule import RingSpec

__all__ = ["acc_dtype", "block_backward", "block_forward", "fold", "merge", "unfold"]

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and merged in: fp32, or ``dtype`` when wider."""
    return torch.promote_types(dtype, torch.float32)


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax merge: two partial results of the same query rows (each output
    normalised by its own softmax, with its log-sum-exp) -> the result over both sets of keys.
    A row that sees no key in either keeps output 0 and log-sum-exp ``-inf``."""
    both = torch.logaddexp(lse, lse_b)
    base = finite(both)
    merged = out * torch.exp(lse - base).unsqueeze(-1) + out_b * torch.exp(lse_b - base).unsqueeze(
        -1
    )
    return merged, both


def fold(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``(..., hkv, g, L, d)`` -> rows ``[lo, hi)`` as ``(..., hkv, g * (hi - lo), d)``."""
    return x[..., lo:hi, :].flatten(-3, -2)


def unfold(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of :func:`fold` over consecutive row ranges, concatenated."""
    return torch.cat([p.unflatten(-2, (groups, -1)) for p in parts], -2)


def _scores(
    qa: torch.Tensor,
    kb: torch.Tensor,
    mask: torch.Tensor | None,
    spec: RingSpec,
    acc: torch.dtype,
) -> torch.Tensor:
    """Scaled scores ``(..., hkv, g * lq, lk)`` in ``acc``, masked entries ``-inf``."""
    s = torch.matmul(qa, kb.transpose(-1, -2)).to(acc) * spec.scale
    if mask is not None:
        shape = s.shape
        s = s.unflatten(-2, (spec.groups, -1)).masked_fill(~mask, -math.inf).reshape(shape)
    return s


def _as4d(x: torch.Tensor, width: int, align: int = 1) -> torch.Tensor:
    """``(batch..., hkv, rows, d)`` -> ``(B, hkv, rows, width)``, zero-padded on the last dim (a
    zero column changes no dot product: the fused kernels want one head size for q, k, v). The
    kernels read any strides but a unit one along the head size (multiples of ``align``, with
    the offset), so a slice of rows or a transposed view goes in as is (bit for bit the result
    of a contiguous copy on the CPU)."""
    x = x.reshape(-1, *x.shape[-3:])
    if x.shape[-1] < width:
        return torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    if x.stride(-1) != 1 or any(s % align for s in (x.storage_offset(), *x.stride()[:-1])):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _additive(
    mask: torch.Tensor | None, groups: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A boolean block mask as the fused kernel's additive one (rows repeated for the query
    heads folded into the rows), and which rows see a key; ``(None, None)`` without a mask."""
    if mask is None:
        return None, None
    if mask.dim() == 2:  # (lq, lk)
        m = mask.repeat(groups, 1)[None, None]
    else:  # (batch..., 1, 1, lq, lk)
        m = mask.reshape(-1, 1, *mask.shape[-2:]).repeat(1, 1, groups, 1)
    return additive(m, dtype), m.any(-1)


def _by_head(x: torch.Tensor, g: int) -> torch.Tensor:
    """``(..., hkv, g * rows, e)`` (query heads folded into the rows) -> ``(..., hkv * g, rows,
    e)``, query head ``h * g + i`` (a view)."""
    return x.unflatten(-2, (g, -1)).flatten(-4, -3)


def _by_row(x: torch.Tensor, g: int) -> torch.Tensor:
    """The inverse of :func:`_by_head`."""
    return x.unflatten(-3, (-1, g)).flatten(-3, -2)


def _spread(x: torch.Tensor, g: int) -> torch.Tensor:
    """``(..., hkv, rows, e)`` -> ``(..., hkv * g, rows, e)``: each key/value head once per query
    head of its group (a copy only when ``g > 1``)."""
    return x if g == 1 else x.unsqueeze(-3).expand(*x.shape[:-2], g, *x.shape[-2:]).flatten(-4, -3)


def block_forward(
    qa: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    mask: torch.Tensor | None,
    spec: RingSpec,
    acc: torch.dtype,
    kern: BlockKernel | None,
    tri: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output ``(..., hkv, rows, dv)`` and log-sum-exp ``(..., hkv, rows)`` in
    ``acc``; ``qa`` holds the query heads of each key/value head folded into its rows; ``tri``
    is the block's causal triangle (:func:`pshard.sequence._ring_schedule.triangle_of`, found
    for fused kernels only); ``kern`` the fused kernel, if any."""
    if kern is None or (tri is None and mask is not None and not kern.masks):
        s = _scores(qa, kb, mask, spec, acc)
        lse_b = torch.logsumexp(s, -1)
        p = torch.exp(s - finite(lse_b).unsqueeze(-1))
        return torch.matmul(p.to(vb.dtype), vb).to(acc), lse_b
    if tri is not None:  # one head per query head, as the kernel's causal flag wants
        g = spec.groups
        q4, k4, v4 = _by_head(qa, g), _spread(kb, g), _spread(vb, g)
        if tri == 0:
            out, lse = _causal(q4, k4, v4, spec, acc, kern)
        else:  # row 0 sees no key; rows 1: against keys :-1 are the lower triangle
            out, lse = _causal(q4[..., 1:, :], k4[..., :-1, :], v4[..., :-1, :], spec, acc, kern)
            out = torch.cat([out.new_zeros((*out.shape[:-2], 1, out.shape[-1])), out], -2)
            lse = torch.cat([lse.new_full((*lse.shape[:-1], 1), -math.inf), lse], -1)
        return _by_row(out, g), _by_row(lse.unsqueeze(-1), g).squeeze(-1)
    add, seen = _additive(mask, spec.groups, acc)
    out, lse = _flash(qa, kb, vb, add, False, spec, acc, kern)
    if seen is not None:  # a row that sees no key: whatever the kernel gave, 0 and -inf
        out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~seen, -math.inf)
    return out, lse


# Rows from which a lower-triangle block is cut in halves. The CPU kernel's causal flag skips
# masked tiles of its own size only: below about 1024 rows a causal call costs as much as a full
# one, and cutting it down to 128 rows (two half-size triangles and one full quarter per level)
# takes 30% off a 512-row block, 14% off a 1024-row one (8 heads of 64, fwd + bwd, one thread).
_LEAF = 128


def _causal(
    qa: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    spec: RingSpec,
    acc: torch.dtype,
    kern: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A lower-triangle block (row ``a`` sees keys ``<= a``) on the fused kernel; on the CPU
    one, cut: the top half as a triangle, the bottom half as the full block against the first
    half of the keys merged with a triangle against the second half."""
    n = qa.shape[-2]
    if not kern.cut or n <= _LEAF:
        return _flash(qa, kb, vb, None, True, spec, acc, kern)
    lo, hi = slice(None, n // 2), slice(n // 2, None)
    top, top_lse = _causal(qa[..., lo, :], kb[..., lo, :], vb[..., lo, :], spec, acc, kern)
    o1, l1 = _flash(qa[..., hi, :], kb[..., lo, :], vb[..., lo, :], None, False, spec, acc, kern)
    o2, l2 = _causal(qa[..., hi, :], kb[..., hi, :], vb[..., hi, :], spec, acc, kern)
    out, lse = merge(o1, l1, o2, l2)  # every row sees a key: finite
    return torch.cat([top, out], -2), torch.cat([top_lse, lse], -1)


def _width(kern: BlockKernel, *xs: torch.Tensor) -> int:
    """The head size the kernel is given: the widest of ``xs``', up to its alignment."""
    w = max(x.shape[-1] for x in xs)
    return -(-w // kern.align) * kern.align


def _flash(
    qa: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    add: torch.Tensor | None,
    causal: bool,
    spec: RingSpec,
    acc: torch.dtype,
    kern: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    width, al = _width(kern, qa, vb), kern.align
    out, lse = kern.forward(
        _as4d(qa.to(acc), width, al), _as4d(kb.to(acc), width, al), _as4d(vb.to(acc), width, al),
        add, causal, spec.scale,
    )  # fmt: skip
    lead = qa.shape[:-1]
    return out[..., : vb.shape[-1]].reshape(*lead, -1), lse.reshape(lead)


def block_backward(
    qa: torch.Tensor,
    kr: torch.Tensor,
    vr: torch.Tensor,
    do: torch.Tensor,
    out_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor | None,
    spec: RingSpec,
    acc: torch.dtype,
    kern: BlockKernel | None,
    tri: int | None = None,
) -> Grads:
    """One block's ``(dq, dk, dv)`` in ``acc``, from the whole softmax's output rows and
    log-sum-exp (finite: 0 where a row sees nothing) and ``delta`` (the rows' ``(do * out)``
    sums); ``tri``, ``kern`` as in :func:`block_forward`."""
    if kern is None or (tri is None and mask is not None and not kern.masks):
        p = torch.exp(_scores(qa, kr, mask, spec, acc) - lse_rows.unsqueeze(-1))
        dp = torch.matmul(do, vr.transpose(-1, -2))
        ds = p * (dp - delta.unsqueeze(-1)) * spec.scale
        return (
            torch.matmul(ds, kr),
            torch.matmul(ds.transpose(-1, -2), qa),
            torch.matmul(p.transpose(-1, -2), do),
        )
    if tri is not None:  # as in block_forward; key/value gradients summed over their group
        g = spec.groups
        q4, do4, o4 = _by_head(qa, g), _by_head(do, g), _by_head(out_rows, g)
        l4 = _by_head(lse_rows.unsqueeze(-1), g).squeeze(-1)
        k4, v4 = _spread(kr, g), _spread(vr, g)
        if tri == 0:
            dq, dk, dv = _causal_backward(q4, k4, v4, do4, o4, l4, spec, kern)
        else:  # row 0 and key -1 take no part
            rows, keys = slice(1, None), slice(None, -1)
            dq, dk, dv = _causal_backward(
                q4[..., rows, :], k4[..., keys, :], v4[..., keys, :], do4[..., rows, :],
                o4[..., rows, :], l4[..., rows], spec, kern,
            )  # fmt: skip
            dq = torch.cat([dq.new_zeros((*dq.shape[:-2], 1, dq.shape[-1])), dq], -2)
            dk = torch.cat([dk, dk.new_zeros((*dk.shape[:-2], 1, dk.shape[-1]))], -2)
            dv = torch.cat([dv, dv.new_zeros((*dv.shape[:-2], 1, dv.shape[-1]))], -2)
        if g > 1:
            dk, dv = dk.unflatten(-3, (-1, g)).sum(-3), dv.unflatten(-3, (-1, g)).sum(-3)
        return _by_row(dq, g), dk, dv
    add, _ = _additive(mask, spec.groups, acc)
    return _flash_backward(qa, kr, vr, do, out_rows, lse_rows, add, False, spec, kern)


def _causal_backward(
    qa: torch.Tensor,
    kr: torch.Tensor,
    vr: torch.Tensor,
    do: torch.Tensor,
    out_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    spec: RingSpec,
    kern: BlockKernel,
) -> Grads:
    """The backward of :func:`_causal`, cut the same way (each piece from the whole softmax's
    output rows and log-sum-exp)."""
    n = qa.shape[-2]
    if not kern.cut or n <= _LEAF:
        return _flash_backward(qa, kr, vr, do, out_rows, lse_rows, None, True, spec, kern)
    lo, hi = slice(None, n // 2), slice(n // 2, None)

    def rows(s: slice) -> tuple[torch.Tensor, ...]:
        return qa[..., s, :], do[..., s, :], out_rows[..., s, :], lse_rows[..., s]

    (q1, do1, o1, l1), (q2, do2, o2, l2) = rows(lo), rows(hi)
    top = _causal_backward(q1, kr[..., lo, :], vr[..., lo, :], do1, o1, l1, spec, kern)
    cross = _flash_backward(
        q2, kr[..., lo, :], vr[..., lo, :], do2, o2, l2, None, False, spec, kern
    )
    bottom = _causal_backward(q2, kr[..., hi, :], vr[..., hi, :], do2, o2, l2, spec, kern)
    return (
        torch.cat([top[0], cross[0] + bottom[0]], -2),
        torch.cat([top[1] + cross[1], bottom[1]], -2),
        torch.cat([top[2] + cross[2], bottom[2]], -2),
    )


def _flash_backward(
    qa: torch.Tensor,
    kr: torch.Tensor,
    vr: torch.Tensor,
    do: torch.Tensor,
    out_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    add: torch.Tensor | None,
    causal: bool,
    spec: RingSpec,
    kern: BlockKernel,
) -> Grads:
    width, al = _width(kern, qa, vr), kern.align
    dq, dk, dv = kern.backward(
        _as4d(do, width, al), _as4d(qa, width, al), _as4d(kr, width, al), _as4d(vr, width, al),
        _as4d(out_rows, width, al), lse_rows.reshape(-1, *lse_rows.shape[-2:]), add, causal,
        spec.scale,
    )  # fmt: skip
    d, dv_ = qa.shape[-1], vr.shape[-1]
    return (
        dq[..., :d].reshape(qa.shape),
        dk[..., :d].reshape(kr.shape),
        dv[..., :dv_].reshape(vr.shape),
    )

"""Ring attention: K/V blocks travel around the axis while each rank attends to the one it holds.

Every rank keeps its queries and passes its key/value block to the next rank ``N - 1`` times, so
after ``N`` steps each query has seen every key. Each step's partial softmax is merged into a
running output with a running log-sum-exp (fp32, or the input dtype when wider), which makes
the result exact attention over the whole sequence. Blocks run on a fused kernel when the
device has one (:mod:`._kernels`: the CPU flash kernel; CUDA efficient attention in float32),
else on explicit matmuls.

Causal masking and padding come from the true global positions of the tokens (the sequence
context of ``shard_map_seq``; outside it, a contiguous layout without padding). Each rank's
tokens are cut into chunks (two halves for causal attention when the local length is even), and
the schedule (:func:`_plan`, pure integer math on the layout) classifies every (query chunk, key
chunk) pair as *full* (no mask), *partial* (masked) or *skipped* (nothing visible), so fully
masked blocks cost nothing. Under ``"zigzag"`` every rank then does the same work; under
``"contiguous"`` the last rank does ``2N - 1`` times the work of the first
(:func:`block_counts` reports it).

The backward is a ``torch.autograd.Function`` (``setup_context`` style, so ``torch.func.grad``
works) that saves only ``(q, k, v, out, lse)``, recomputes each block's probabilities, and sends
the fp32 key/value gradients around the ring with the blocks, so they arrive at their owner
after ``N`` hops. Memory per rank is ``O(s / N)`` saved activations plus one block of scores at
a time. Grouped-query attention sends the key/value heads only; query heads are grouped
against them locally (no copies of K/V).

Internal interface: ``block_counts(kind, length, size, causal)`` (per-rank :class:`BlockCounts`)
and ``ring_bytes(...)`` are for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import torch

from .._collectives.functions import call
from .._runtime import wire as raw
from .._runtime.mesh import Axis
from ._context import context_scope
from ._kernels import BlockKernel, additive, block_kernel, finite
from ._layouts import SeqLayout, pad_permute
from ._masks import (
    Window,
    check_window,
    position_mask,
    segment_mask,
    visible_counts,
)
from ._qkv import attention_args, token_layout

__all__ = ["BlockCounts", "GatheredLayout", "block_counts", "ring_attention", "ring_core"]

_FN = "ring_attention"

# --------------------------------------------------------------------------- the schedule


class BlockCounts(NamedTuple):
    """(query chunk, key chunk) pairs one rank computes over a whole ring pass.

    Attributes:
        full: pairs computed without a mask.
        partial: pairs computed with a mask (causal diagonal or padding).
        skipped: pairs that are fully masked and not computed.
    """

    full: int
    partial: int
    skipped: int

    @property
    def work(self) -> float:
        """Attention work in chunk pairs, a masked (diagonal) pair counting one half."""
        return self.full + self.partial / 2


class _Step(NamedTuple):
    """One matmul of a step: query chunk ``q`` against key chunk ``k`` of the block held."""

    q: int
    k: int
    masked: bool


def _bounds(local: int, chunks: int) -> tuple[int, ...]:
    return tuple(local * i // chunks for i in range(chunks + 1))


def _chunks(layout: Any, causal: bool, window: Window | None) -> int:
    """How many chunks a rank's tokens are cut into for the schedule: two per gathered rank
    (its halves: under zigzag, its early and its late chunk) when a mask can skip blocks."""
    if not (causal or window is not None):
        return 1
    inner = getattr(layout, "inner", 1)
    base = layout.local_length // inner
    return 2 * inner if base and base % 2 == 0 else inner


def _classify(
    qs: tuple[int, ...], ks: tuple[int, ...], length: int, causal: bool, window: Window | None
) -> str:
    """``"skip"``, ``"full"`` or ``"partial"`` for sets of query and key positions."""
    seen = visible_counts(qs, sorted(ks), length, causal, window)
    if not seen.any():
        return "skip"
    return "full" if bool((seen == len(ks)).all()) else "partial"


@functools.lru_cache(maxsize=256)
def _plan(
    layout: Any, rank: int, causal: bool, window: Window | None = None
) -> tuple[tuple[tuple[_Step, ...], ...], BlockCounts]:
    """For each ring step ``t`` (holding the block of rank ``(rank - t) % size``), the
    (query chunk, key chunk) matmuls to run, by position alone; and the pair counts.

    ``layout`` says where the tokens are: a :class:`SeqLayout`, or any hashable object with its
    ``length``, ``size``, ``local_length``, ``positions(rank)`` and ``position_tensor(rank,
    device)`` (:class:`GatheredLayout` for the ring part of ``usp_attention``)."""
    length, size = layout.length, layout.size
    b = _bounds(layout.local_length, _chunks(layout, causal, window))
    mine = layout.positions(rank)
    counts = {"full": 0, "partial": 0, "skip": 0}
    steps = []
    for t in range(size):
        theirs = layout.positions((rank - t) % size)
        step = []
        for a in range(len(b) - 1):
            for j in range(len(b) - 1):
                x = _classify(
                    mine[b[a] : b[a + 1]], theirs[b[j] : b[j + 1]], length, causal, window
                )
                counts[x] += 1
                if x != "skip":
                    step.append(_Step(a, j, x == "partial"))
        steps.append(tuple(step))
    return tuple(steps), BlockCounts(counts["full"], counts["partial"], counts["skip"])


def block_counts(
    kind: str,
    length: int,
    size: int,
    causal: bool,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[BlockCounts, ...]:
    """Per-rank :class:`BlockCounts` of ``ring_attention`` for a sequence of ``length`` tokens
    laid out by ``kind`` on ``size`` ranks (the schedule the kernel runs). With
    ``segment_ids`` (the whole sequence's, ``(batch, length)``) the pairs the segments mask
    for every row are counted as skipped, and pairs they mask in part as partial, as the kernel
    decides at run time.

    Example:
        >>> import torch
        >>> from pshard.sequence._ring import block_counts
        >>> [c.work for c in block_counts("contiguous", 8, 2, causal=True)]
        [2.0, 6.0]
        >>> [c.work for c in block_counts("zigzag", 8, 2, causal=True)]
        [4.0, 4.0]
        >>> two_docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
        >>> [c.skipped for c in block_counts("zigzag", 8, 2, True, segment_ids=two_docs)]
        [5, 5]
    """
    win = check_window("block_counts", window)
    if segment_ids is None:
        layout = SeqLayout(kind, length, size)
        return tuple(_plan(layout, r, bool(causal), win)[1] for r in range(size))
    layout = SeqLayout(kind, length, size)
    spec = _Spec(layout, bool(causal), 1.0, 1, win)
    every = pad_permute(segment_ids.to(torch.int64), 1, layout, -1)
    out = []
    for r in range(size):
        steps, static = _plan(layout, r, bool(causal), win)
        b = _bounds(layout.local_length, _chunks(layout, spec.causal, win))
        segs = (every.chunk(size, 1)[r], every)
        full = partial = 0
        for t in range(size):
            for st in steps[t]:
                mask = _block_mask(spec, r, (r - t) % size, st, b, segs, every.device)
                full += mask is None
                partial += mask is not None and mask is not False
        out.append(
            BlockCounts(
                full, partial, static.full + static.partial + static.skipped - full - partial
            )
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GatheredLayout:
    """The tokens a ring rank holds after an all-to-all that gathered the sequence over an inner
    axis of ``inner`` ranks (``usp_attention``): ring rank ``r`` holds, in order, the tokens of
    ranks ``r * inner + u`` (``u = 0 .. inner - 1``) of ``base``, a layout over
    ``size * inner`` ranks."""

    base: SeqLayout
    size: int  # ring ranks
    inner: int  # ranks gathered into each ring rank

    @property
    def length(self) -> int:
        return self.base.length

    @property
    def local_length(self) -> int:
        return self.base.local_length * self.inner

    @property
    def kind(self) -> str:
        return f"{self.base.kind} gathered by {self.inner}"

    def positions(self, rank: int) -> tuple[int, ...]:
        return tuple(
            p for u in range(self.inner) for p in self.base.positions(rank * self.inner + u)
        )

    def position_tensor(self, rank: int, device: Any) -> torch.Tensor:
        return torch.cat(
            [self.base.position_tensor(rank * self.inner + u, device) for u in range(self.inner)]
        )


# --------------------------------------------------------------------------- the kernel


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything the kernel needs besides the tensors (hashable, no tensors)."""

    layout: Any  # a SeqLayout, or a GatheredLayout (see _plan)
    causal: bool
    scale: float
    groups: int  # query heads per key/value head
    window: Window | None = None


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_mask(
    spec: _Spec,
    rank: int,
    src: int,
    st: _Step,
    b: tuple[int, ...],
    segs: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
) -> Any:
    """The mask of one matmul: ``None`` (every key visible), a boolean ``(lq, lk)`` or
    ``(batch..., 1, 1, lq, lk)`` mask, or ``False`` when the segments leave nothing visible in
    any row (the matmul is skipped). Forward and backward both call it, so they agree."""
    lay = spec.layout
    q0, q1, k0, k1 = b[st.q], b[st.q + 1], b[st.k], b[st.k + 1]
    mask = None
    if st.masked:
        qp = lay.position_tensor(rank, device)[q0:q1]
        kp = lay.position_tensor(src, device)[k0:k1]
        mask = position_mask(qp, kp, lay.length, spec.causal, spec.window)
    if segs is None:
        return mask
    mine, every = segs
    off = src * lay.local_length
    m = segment_mask(mine[..., q0:q1], every[..., off + k0 : off + k1])
    if mask is not None:
        m = m & mask
    if not bool(m.any()):
        return False
    if bool(m.all()):
        return None
    return m.unsqueeze(-3).unsqueeze(-3)


def _block_kind(
    spec: _Spec,
    rank: int,
    src: int,
    st: _Step,
    b: tuple[int, ...],
    segs: Any,
    kern: BlockKernel | None,
    device: torch.device,
) -> tuple[Any, int | None]:
    """One matmul's mask (:func:`_block_mask`) and triangle (:func:`_triangle`, with a fused
    kernel only); a triangle needs no mask, none is built."""
    tri = _triangle(spec, rank, src, st, b, segs) if kern is not None else None
    if tri is not None:
        return None, tri
    return _block_mask(spec, rank, src, st, b, segs, device), None


def _triangle(
    spec: _Spec, rank: int, src: int, st: _Step, b: tuple[int, ...], segs: Any
) -> int | None:
    """``0`` when a block's mask is exactly the lower triangle (query row ``a`` sees key
    ``j <= a``: a chunk against itself, or a stripe chunk against an earlier rank's), ``1`` when
    it is the strict one (``j < a``: a stripe chunk against a later rank's), else ``None``. The
    fused kernels compute both with their own causal flag, skipping the masked half (the strict
    one on rows ``1:`` against keys ``:-1``). Only for causal masks without a window, segments
    or padding (grouped query heads are unfolded into heads for the kernel)."""
    if not (st.masked and spec.causal):
        return None
    if spec.window is not None or segs is not None:
        return None
    return _triangle_of(spec.layout, rank, src, b[st.q], b[st.q + 1], b[st.k], b[st.k + 1])


@functools.lru_cache(maxsize=1024)
def _triangle_of(
    layout: Any, rank: int, src: int, q0: int, q1: int, k0: int, k1: int
) -> int | None:
    """The triangle of query positions ``[q0, q1)`` of ``rank`` against key positions
    ``[k0, k1)`` of ``src`` (see :func:`_triangle`), from the positions alone, in linear time:
    both increase, the queries and the keys the triangle takes are real tokens, and each query
    row ``a`` sees exactly the keys before ``a + 1 - offset``."""
    qp, kp = layout.positions(rank)[q0:q1], layout.positions(src)[k0:k1]
    n = len(qp)
    if len(kp) != n or n < 2 or qp[-1] >= layout.length or not (_rising(qp) and _rising(kp)):
        return None
    for offset in (0, 1):
        if kp[n - 1 - offset] >= layout.length:  # a key the triangle takes is padding
            continue
        # row a sees keys [0, m) with kp[m - 1] <= qp[a] < kp[m]: m must be a + 1 - offset
        if all(
            (m == 0 or kp[m - 1] <= p) and (m == n or p < kp[m])
            for m, p in ((a + 1 - offset, p) for a, p in enumerate(qp))
        ):
            return offset
    return None


def _rising(pos: tuple[int, ...]) -> bool:
    return all(a < b for a, b in zip(pos[:-1], pos[1:], strict=True))


def _scores(qa, kb, mask, spec: _Spec, acc) -> torch.Tensor:
    """Scaled scores ``(..., hkv, g * lq, lk)`` in ``acc``, masked entries ``-inf``."""
    s = torch.matmul(qa, kb.transpose(-1, -2)).to(acc) * spec.scale
    if mask is not None:
        shape = s.shape
        s = s.unflatten(-2, (spec.groups, -1)).masked_fill(~mask, -math.inf).reshape(shape)
    return s


def _fold(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``(..., hkv, g, L, d)`` -> rows ``[lo, hi)`` as ``(..., hkv, g * (hi - lo), d)``."""
    return x[..., lo:hi, :].flatten(-3, -2)


def _unfold(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    return torch.cat([p.unflatten(-2, (groups, -1)) for p in parts], -2)


def _schedule(spec: _Spec, n: int, r: int) -> tuple[Any, tuple[int, ...]]:
    lay = spec.layout
    steps, _ = _plan(lay, r, spec.causal, spec.window)
    return steps, _bounds(lay.local_length, _chunks(lay, spec.causal, spec.window))


def _explicit(kern: BlockKernel | None, mask: Any, tri: int | None) -> bool:
    """Whether a block runs on explicit matmuls: no fused kernel, or a mask it does not take."""
    return kern is None or (tri is None and mask is not None and not kern.masks)


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


def _additive(mask: Any, groups: int, dtype: torch.dtype) -> Any:
    """A boolean block mask as the fused kernel's additive one (rows repeated for the query
    heads folded into the rows), and which rows see a key; ``(None, None)`` without a mask."""
    if mask is None:
        return None, None
    if mask.dim() == 2:  # (lq, lk)
        m = mask.repeat(groups, 1)[None, None]
    else:  # (batch..., 1, 1, lq, lk)
        m = mask.reshape(-1, 1, *mask.shape[-2:]).repeat(1, 1, groups, 1)
    return additive(m, dtype), m.any(-1)


def _block_forward(
    qa, kb, vb, mask, spec: _Spec, acc, kern: BlockKernel | None, tri: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output ``(..., hkv, rows, dv)`` and log-sum-exp ``(..., hkv, rows)`` in
    ``acc``; ``qa`` holds the query heads of each key/value head folded into its rows; ``tri``
    as :func:`_triangle` says; ``kern`` the fused kernel, if any."""
    if _explicit(kern, mask, tri):
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


# Rows from which a lower-triangle block is cut in halves. The CPU kernel's causal flag skips
# masked tiles of its own size only: below about 1024 rows a causal call costs as much as a full
# one, and cutting it down to 128 rows (two half-size triangles and one full quarter per level)
# takes 30% off a 512-row block, 14% off a 1024-row one (8 heads of 64, fwd + bwd, one thread).
_LEAF = 128


def _causal(qa, kb, vb, spec: _Spec, acc, kern: BlockKernel) -> tuple[torch.Tensor, torch.Tensor]:
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
    lse = torch.logaddexp(l1, l2)  # every row sees a key: finite
    out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    return torch.cat([top, out], -2), torch.cat([top_lse, lse], -1)


def _width(kern: BlockKernel, *xs: torch.Tensor) -> int:
    """The head size the kernel is given: the widest of ``xs``', up to its alignment."""
    w = max(x.shape[-1] for x in xs)
    return -(-w // kern.align) * kern.align


def _flash(
    qa, kb, vb, add, causal: bool, spec: _Spec, acc, kern: BlockKernel
) -> tuple[torch.Tensor, torch.Tensor]:
    width, al = _width(kern, qa, vb), kern.align
    out, lse = kern.forward(
        _as4d(qa.to(acc), width, al), _as4d(kb.to(acc), width, al), _as4d(vb.to(acc), width, al),
        add, causal, spec.scale,
    )  # fmt: skip
    lead = qa.shape[:-1]
    return out[..., : vb.shape[-1]].reshape(*lead, -1), lse.reshape(lead)


def _block_backward(
    qa, kr, vr, do, out_rows, lse_rows, delta, mask, spec: _Spec, acc, kern, tri=None
):
    """One block's ``(dq, dk, dv)`` in ``acc``, from the whole softmax's output rows and
    log-sum-exp (finite: 0 where a row sees nothing); ``tri``, ``kern`` as in
    :func:`_block_forward`."""
    if _explicit(kern, mask, tri):
        p = torch.exp(_scores(qa, kr, mask, spec, acc) - lse_rows.unsqueeze(-1))
        dp = torch.matmul(do, vr.transpose(-1, -2))
        ds = p * (dp - delta.unsqueeze(-1)) * spec.scale
        return (
            torch.matmul(ds, kr),
            torch.matmul(ds.transpose(-1, -2), qa),
            torch.matmul(p.transpose(-1, -2), do),
        )
    if tri is not None:  # as in _block_forward; key/value gradients summed over their group
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


def _causal_backward(qa, kr, vr, do, out_rows, lse_rows, spec: _Spec, kern: BlockKernel):
    """The backward of :func:`_causal`, cut the same way (each piece from the whole softmax's
    output rows and log-sum-exp)."""
    n = qa.shape[-2]
    if not kern.cut or n <= _LEAF:
        return _flash_backward(qa, kr, vr, do, out_rows, lse_rows, None, True, spec, kern)
    lo, hi = slice(None, n // 2), slice(n // 2, None)

    def rows(s: slice) -> tuple:
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


def _flash_backward(qa, kr, vr, do, out_rows, lse_rows, add, causal: bool, spec: _Spec, kern):
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


def _ring_forward(q, k, v, segs, c: raw.Comm, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``: ``(..., hkv, g, L, d)``; ``k``, ``v``: ``(..., hkv, L, d)``; ``segs``: ``None``
    or (this rank's segment ids ``(..., L)``, every rank's ``(..., N * L)``). Returns ``out``
    ``(..., hkv, g, L, dv)`` in q's dtype and ``lse`` ``(..., hkv, g, L)`` in the acc dtype."""
    acc, n, r, dk = _acc(q.dtype), c.size, c.rank, k.shape[-1]
    kern = block_kernel(q.device, acc, max(dk, v.shape[-1]))
    steps, b = _schedule(spec, n, r)
    qs = [_fold(q, b[a], b[a + 1]) for a in range(len(b) - 1)]
    # a query chunk's first block is its running result as is; chunks that never see a key
    # are filled in at the end (zeros, log-sum-exp -inf)
    outs: list[Any] = [None] * len(qs)
    lses: list[Any] = [None] * len(qs)
    perm = tuple((i, (i + 1) % n) for i in range(n))
    kv = torch.cat([k, v], -1) if n > 1 else None
    for t in range(n):
        src = (r - t) % n
        kb, vb = (k, v) if t == 0 else kv.split([dk, kv.shape[-1] - dk], -1)
        # The next block travels while this one is computed against.
        nxt, pending = raw.ppermute_start(kv, c, perm) if t < n - 1 else (None, [])
        for st in steps[t]:
            mask, tri = _block_kind(spec, r, src, st, b, segs, kern, q.device)
            if mask is False:
                continue
            lo, hi = b[st.k], b[st.k + 1]
            o_b, lse_b = _block_forward(
                qs[st.q], kb[..., lo:hi, :], vb[..., lo:hi, :], mask, spec, acc, kern, tri
            )
            if outs[st.q] is None:
                outs[st.q], lses[st.q] = o_b, lse_b
                continue
            lse = torch.logaddexp(lses[st.q], lse_b)
            base = finite(lse)
            outs[st.q] = outs[st.q] * torch.exp(lses[st.q] - base).unsqueeze(-1) + o_b * torch.exp(
                lse_b - base
            ).unsqueeze(-1)
            lses[st.q] = lse
        raw.wait(pending)
        kv = nxt
    for a, x in enumerate(qs):
        if outs[a] is None:
            outs[a] = q.new_zeros((*x.shape[:-1], v.shape[-1]), dtype=acc)
            lses[a] = q.new_full(x.shape[:-1], -math.inf, dtype=acc)
    out = _unfold(outs, spec.groups).to(q.dtype)
    return out, torch.cat([x.unflatten(-1, (spec.groups, -1)) for x in lses], -1)


def _ring_backward(q, k, v, out, lse, dout, segs, c: raw.Comm, spec: _Spec):
    acc, n, r, dk = _acc(q.dtype), c.size, c.rank, k.shape[-1]
    kern = block_kernel(q.device, acc, max(dk, v.shape[-1]))
    steps, b = _schedule(spec, n, r)
    chunks = range(len(b) - 1)
    qs = [_fold(q, b[a], b[a + 1]).to(acc) for a in chunks]
    dos = [_fold(dout, b[a], b[a + 1]).to(acc) for a in chunks]
    lses = [finite(lse[..., b[a] : b[a + 1]].flatten(-2)) for a in chunks]
    outs = [_fold(out, b[a], b[a + 1]).to(acc) for a in chunks]
    deltas = [(do * o).sum(-1) for do, o in zip(dos, outs, strict=True)]
    dqs: list[Any] = [None] * len(qs)  # assigned by a chunk's first block, then summed into
    perm = tuple((i, (i + 1) % n) for i in range(n))
    kv = torch.cat([k, v], -1).to(acc)
    # dK/dV of the block held at step t are computed into a fresh buffer while the partial sums
    # of the block sent at step t - 1 travel; they are added on arrival and sent on, so after n
    # hops every block's gradient is back at its owner. Both transfers are issued in the same
    # order on every rank, which is what matches them.
    incoming, dkv_pending = None, []
    for t in range(n):
        src = (r - t) % n
        kb, vb = kv.split([dk, kv.shape[-1] - dk], -1)
        nxt, kv_pending = raw.ppermute_start(kv, c, perm) if t < n - 1 else (None, [])
        dkv = torch.empty_like(kv)
        written: set[int] = set()  # key chunks of dkv holding a block's gradient
        for st in steps[t]:
            mask, tri = _block_kind(spec, r, src, st, b, segs, kern, q.device)
            if mask is False:
                continue
            lo, hi = b[st.k], b[st.k + 1]
            a = st.q
            dq_b, dk_b, dv_b = _block_backward(
                qs[a], kb[..., lo:hi, :], vb[..., lo:hi, :], dos[a], outs[a], lses[a],
                deltas[a], mask, spec, acc, kern, tri,
            )  # fmt: skip
            dqs[a] = dq_b if dqs[a] is None else dqs[a].add_(dq_b)
            if st.k in written:
                dkv[..., lo:hi, :dk] += dk_b
                dkv[..., lo:hi, dk:] += dv_b
            else:
                dkv[..., lo:hi, :dk] = dk_b
                dkv[..., lo:hi, dk:] = dv_b
                written.add(st.k)
        for j in range(len(b) - 1):
            if j not in written:
                dkv[..., b[j] : b[j + 1], :].zero_()
        raw.wait(dkv_pending)
        if incoming is not None:
            dkv += incoming
        if n > 1:
            incoming, dkv_pending = raw.ppermute_start(dkv, c, perm)
        else:
            incoming = dkv
        raw.wait(kv_pending)
        kv = nxt
    raw.wait(dkv_pending)
    dkv = incoming
    dqs = [torch.zeros_like(x) if g is None else g for g, x in zip(dqs, qs, strict=True)]
    dq = _unfold(dqs, spec.groups).to(q.dtype)
    dkb, dvb = dkv.split([dk, dkv.shape[-1] - dk], -1)
    return dq, dkb.to(k.dtype), dvb.to(v.dtype)


class _Ring(torch.autograd.Function):
    """Forward ``(out, lse)``; backward through :class:`_RingGrad`."""

    @staticmethod
    def forward(q, k, v, mine, every, c: raw.Comm, spec: _Spec):  # type: ignore[override]
        return _ring_forward(q, k, v, None if mine is None else (mine, every), c, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, mine, every, c, spec = inputs
        out, lse = output
        ctx.c, ctx.spec = c, spec
        ctx.save_for_backward(q, k, v, out, lse, mine, every)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse, mine, every = ctx.saved_tensors
        dq, dk, dv = call(_RingGrad, q, k, v, out, lse, dout, mine, every, ctx.c, ctx.spec)
        return dq, dk, dv, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(
            f"{_FN}: forward-mode differentiation (torch.func.jvp, jacfwd, hessian) is not "
            f"supported; use reverse mode (torch.func.grad, vjp, jacrev or .backward())"
        )

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        raise NotImplementedError(
            f"{_FN}: torch.func.vmap over ring_attention is not supported; it already takes "
            f"any number of leading batch dims: stack the batch into q, k, v instead"
        )


def _no_higher_order(*_: Any) -> Any:
    raise NotImplementedError(
        f"{_FN}: higher-order derivatives (grad of grad, hessian, backward with "
        f"create_graph=True followed by another backward) are not supported; ring_attention "
        f"has first-order gradients only"
    )


class _RingGrad(torch.autograd.Function):
    """The backward as its own Function, so that differentiating it again raises instead of
    silently missing the communication."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, mine, every, c: raw.Comm, spec: _Spec):  # type: ignore[override]
        segs = None if mine is None else (mine, every)
        return _ring_backward(q, k, v, out, lse, dout, segs, c, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        _no_higher_order()

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        _no_higher_order()

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        _no_higher_order()


# --------------------------------------------------------------------------- the public function


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: Axis = "sp",
    causal: bool = False,
    segment_ids: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_dim: int = 1,
    head_dim: int = 2,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence from this rank's sequence shard (ring attention).

    Each rank keeps its queries; the key/value blocks travel around the axis (``ppermute`` to
    the next rank, ``N - 1`` times) while each rank attends to the block it holds, and the
    partial softmaxes are merged online with a running log-sum-exp in fp32 (or the input dtype
    when wider). In pseudo-code, on rank ``r`` of ``N``::

        out, lse = 0, -inf
        for t in range(N):                       # holding the block of rank (r - t) % N
            o_t, lse_t = softmax_block(q, k, v)  # masked by global position; skipped if empty
            out, lse = merge(out, lse, o_t, lse_t)
            k, v = ppermute((k, v), to=r + 1)
        return out

    Inside ``shard_map_seq`` it knows the layout: ``causal=True`` masks by the true global
    positions under every layout, and padding tokens are never attended to (their own output
    rows are zero). Outside, rank ``r`` is taken to hold ``[r * L, (r + 1) * L)`` unpadded.
    Blocks that are fully masked are skipped, so ``layout="zigzag"`` balances causal attention
    across ranks, while ``"contiguous"`` leaves the last rank ``2N - 1`` times the work of the
    first.

    Masks (global positions, every layout): ``segment_ids`` restricts each query to the keys of
    its own segment (packed documents; a negative id sees and is seen by nothing), ``window``
    to a sliding window (``w``: Hugging Face's ``sliding_window``, query ``i`` sees key ``j``
    when ``i - w < j``; ``(left, right)``: ``i - left <= j <= i + right``, ``None`` or ``-1``
    for an unbounded side). Both combine with ``causal``; a query that sees no key outputs 0
    and gets 0 gradient. Blocks outside the window are skipped by the schedule; the segment ids
    of every rank are gathered once per call (one all-gather of ints, instead of ``N - 1``
    transfers beside the K/V blocks), and blocks in which no query shares a segment with any
    key are skipped at run time.

    Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not) the
    recomputation in the backward pass uses the layout recorded by the forward's
    ``shard_map_seq``, so checkpointed layers give the same numbers.

    Grouped-query attention: ``k``, ``v`` may have fewer heads than ``q`` (a divisor of them);
    only the key/value heads travel, and each is used by its group of query heads locally.

    Gradients (``.backward()``, ``torch.func.grad``, ``vjp``, ``jacrev``) come from a
    memory-efficient backward that saves only ``q, k, v``, the output and the log-sum-exp,
    recomputes each block, and sends the key/value gradients (fp32) around the ring back to
    their owner. Forward-mode differentiation (``jvp``, ``jacfwd``), higher-order derivatives
    and ``torch.func.vmap`` are not supported: they raise ``NotImplementedError`` (batch with
    leading dims instead of ``vmap``).

    Args:
        q, k, v: this rank's shard, ``(batch, seq, heads, head_size)`` by default (``seq_dim``,
            ``head_dim`` say otherwise; any other dims are batch dims; the last dim is the head
            size, which ``v`` may have different). One floating dtype for all three.
        axis: the sequence-parallel mesh axis.
        causal: causal masking by global position.
        segment_ids: this rank's segment id of every token, an integer tensor of ``q``'s shape
            without the head and feature dims (``(batch, seq)`` by default).
        window: a sliding window on global positions, ``w`` or ``(left, right)``.
        seq_dim: the sequence dim of ``q``, ``k``, ``v``.
        head_dim: the head dim.
        scale: the softmax scale (default ``1 / sqrt(head_size)``).

    Returns:
        This rank's shard of the attention output (``q``'s shape with ``v``'s head size, ``q``'s
        dtype).

    Raises:
        ValueError: the key/value heads do not divide the query heads, the shapes disagree, the
            local length is not the one ``shard_map_seq`` gave this rank, or the window is
            malformed.
        TypeError: q, k, v are not tensors of one floating dtype, or ``segment_ids`` is not an
            integer tensor.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> q, k, v = torch.randn(3, 2, 5, 4, 8).unbind(0)        # (batch, seq, heads, size)
        >>> out = ps.ring_attention(q, k, v, causal=True)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        >>> torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
        True
    """
    a = attention_args(_FN, q, k, v, axis, seq_dim, head_dim, segment_ids, window)
    with context_scope(a.ctx):
        c = raw.comm(axis, _FN)
    layout = token_layout(_FN, a.ctx, c.size, q, a.sd)
    return ring_core(q, k, v, a.segments, layout, c, bool(causal), a.window, scale, a.sd, a.hd)


def ring_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mine: torch.Tensor | None,
    layout: Any,
    c: raw.Comm,
    causal: bool,
    window: Window | None,
    scale: float | None,
    sd: int,
    hd: int,
) -> torch.Tensor:
    """Ring attention on checked arguments: ``layout`` says where every ring rank's tokens are
    (see :func:`_plan`), ``mine`` this rank's segment ids (sequence last) or ``None``."""
    hq, hkv = q.shape[hd], k.shape[hd]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    spec = _Spec(layout, causal, float(scale), hq // hkv, window)
    every = None
    if mine is not None:
        every = raw.all_gather(mine, c, mine.dim() - 1, True) if c.size > 1 else mine
    qt = q.movedim((hd, sd), (-3, -2)).unflatten(-3, (hkv, hq // hkv))
    kt, vt = (t.movedim((hd, sd), (-3, -2)) for t in (k, v))
    out, _ = call(_Ring, qt, kt, vt, mine, every, c, spec)
    return out.flatten(-4, -3).movedim((-3, -2), (hd, sd))

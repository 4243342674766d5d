"""The schedule of ring attention: which (query chunk, key chunk) blocks a rank computes, and
with which mask, decided from the tokens' global positions alone.

Each rank's tokens are cut into chunks (two halves for causal or windowed attention when the
local length is even, one per gathered rank and half of it under ``usp_attention``). For every
ring step ``t`` (the rank holding the key/value block of rank ``(rank - t) % size``),
:func:`plan` classifies every (query chunk, key chunk) pair as *full* (no mask), *partial*
(masked) or *skipped* (nothing visible), so fully masked blocks cost nothing. Under
``"zigzag"`` every rank then does the same work; under ``"contiguous"`` the last rank does
``2N - 1`` times the work of the first (:func:`block_counts` reports it).

At run time :func:`block_kind` refines one planned block with the segment ids of the call: its
boolean mask (:func:`block_mask`), ``False`` when the segments leave nothing visible (the block
is skipped too), or, for a fused kernel, the causal triangle it is (:func:`triangle_of`), which
the kernel computes with its own causal flag and no mask.

Pure position logic: no process group, no kernel. The plans and triangles are cached
(:mod:`pshard._core.caches`).

Internal interface:

- ``TokenLayout``: where a ring rank's tokens are (a :class:`~pshard.sequence._layouts.SeqLayout`
  or a :class:`GatheredLayout`).
- ``RingSpec``: everything about one ring attention call but its tensors.
- ``Step``, ``plan(layout, rank, causal, window)``, ``chunk_bounds(local, chunks)``,
  ``schedule(spec, rank)``: the planned blocks of every step and the chunk boundaries.
- ``block_mask``, ``block_kind``, ``triangle_of``: one block's mask or triangle.
- ``BlockCounts``, ``block_counts(...)``: per-rank pair counts, for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple, Protocol

import torch

from .._compat import tracing
from .._core.caches import cached
from ._layouts import SeqLayout, pad_permute
from ._masks import Window, check_window, position_mask, segment_mask, visible_counts

__all__ = [
    "BlockCounts",
    "GatheredLayout",
    "RingSpec",
    "Segments",
    "Step",
    "TokenLayout",
    "block_counts",
    "block_kind",
    "block_mask",
    "chunk_bounds",
    "plan",
    "schedule",
    "triangle_of",
]

#: This rank's segment ids (sequence last) and every ring rank's, concatenated in ring order.
Segments = tuple[torch.Tensor, torch.Tensor]

#: One block's mask: ``None`` (every key visible), a boolean tensor, or ``False`` (skipped).
BlockMask = torch.Tensor | Literal[False] | None


class TokenLayout(Protocol):
    """Where the tokens of each ring rank are: ``size`` ranks of ``local_length`` tokens of a
    sequence of ``length``; ``positions(rank)`` in each rank's local order (values ``>=
    length`` are padding). Hashable (it keys the cached plans)."""

    @property
    def length(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def local_length(self) -> int: ...

    def positions(self, rank: int) -> tuple[int, ...]: ...

    def position_tensor(self, rank: int, device: torch.device) -> torch.Tensor: ...


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

    def position_tensor(self, rank: int, device: torch.device) -> torch.Tensor:
        return torch.cat(
            [self.base.position_tensor(rank * self.inner + u, device) for u in range(self.inner)]
        )


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Everything a ring pass needs besides the tensors (hashable, no tensors)."""

    layout: TokenLayout
    causal: bool
    scale: float
    groups: int  # query heads per key/value head
    window: Window | None = None


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


class Step(NamedTuple):
    """One matmul of a step: query chunk ``q`` against key chunk ``k`` of the block held."""

    q: int
    k: int
    masked: bool


def chunk_bounds(local: int, chunks: int) -> tuple[int, ...]:
    """The boundaries of ``chunks`` near-equal chunks of ``local`` tokens."""
    return tuple(local * i // chunks for i in range(chunks + 1))


def _chunks(layout: TokenLayout, causal: bool, window: Window | None) -> int:
    """How many chunks a rank's tokens are cut into for the schedule: two per gathered rank
    (its halves: under zigzag, its early and its late chunk) when a mask can skip blocks."""
    if not (causal or window is not None):
        return 1
    inner = layout.inner if isinstance(layout, GatheredLayout) else 1
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


@cached("ring attention block plans", 256)
def plan(
    layout: TokenLayout, rank: int, causal: bool, window: Window | None = None
) -> tuple[tuple[tuple[Step, ...], ...], BlockCounts]:
    """For each ring step ``t`` (holding the block of rank ``(rank - t) % size``), the
    (query chunk, key chunk) matmuls to run, by position alone; and the pair counts."""
    length, size = layout.length, layout.size
    b = chunk_bounds(layout.local_length, _chunks(layout, causal, window))
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
                    step.append(Step(a, j, x == "partial"))
        steps.append(tuple(step))
    return tuple(steps), BlockCounts(counts["full"], counts["partial"], counts["skip"])


def schedule(spec: RingSpec, rank: int) -> tuple[tuple[tuple[Step, ...], ...], tuple[int, ...]]:
    """``rank``'s planned matmuls of every step (:func:`plan`) and its chunk boundaries."""
    lay = spec.layout
    steps, _ = plan(lay, rank, spec.causal, spec.window)
    return steps, chunk_bounds(lay.local_length, _chunks(lay, spec.causal, spec.window))


def block_mask(
    spec: RingSpec,
    rank: int,
    src: int,
    st: Step,
    b: tuple[int, ...],
    segs: Segments | None,
    device: torch.device,
) -> BlockMask:
    """The mask of one matmul: ``None`` (every key visible), a boolean ``(lq, lk)`` or
    ``(batch..., 1, 1, lq, lk)`` mask, or ``False`` when the segments leave nothing visible in
    any row (the matmul is skipped). Forward and backward both call it, so they agree. While
    traced the segments are data: the mask, whatever it holds."""
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
    if tracing([m]):  # a program (ps.jit): no skipping on values, the block runs masked
        return m.unsqueeze(-3).unsqueeze(-3)
    if not bool(m.any()):
        return False
    if bool(m.all()):
        return None
    return m.unsqueeze(-3).unsqueeze(-3)


def block_kind(
    spec: RingSpec,
    rank: int,
    src: int,
    st: Step,
    b: tuple[int, ...],
    segs: Segments | None,
    fused: bool,
    device: torch.device,
) -> tuple[BlockMask, int | None]:
    """One matmul's mask (:func:`block_mask`) and, on a ``fused`` kernel, its triangle
    (:func:`_triangle`); a triangle needs no mask, none is built."""
    tri = _triangle(spec, rank, src, st, b, segs) if fused else None
    if tri is not None:
        return None, tri
    return block_mask(spec, rank, src, st, b, segs, device), None


def _triangle(
    spec: RingSpec, rank: int, src: int, st: Step, b: tuple[int, ...], segs: Segments | None
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
    return triangle_of(spec.layout, rank, src, b[st.q], b[st.q + 1], b[st.k], b[st.k + 1])


@cached("ring attention causal triangles", 1024)
def triangle_of(
    layout: TokenLayout, rank: int, src: int, q0: int, q1: int, k0: int, k1: int
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
        >>> from pshard.sequence._ring_schedule import block_counts
        >>> [c.work for c in block_counts("contiguous", 8, 2, causal=True)]
        [2.0, 6.0]
        >>> [c.work for c in block_counts("zigzag", 8, 2, causal=True)]
        [4.0, 4.0]
        >>> two_docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
        >>> [c.skipped for c in block_counts("zigzag", 8, 2, True, segment_ids=two_docs)]
        [5, 5]
    """
    win = check_window("block_counts", window)
    layout = SeqLayout(kind, length, size)
    if segment_ids is None:
        return tuple(plan(layout, r, bool(causal), win)[1] for r in range(size))
    spec = RingSpec(layout, bool(causal), 1.0, 1, win)
    every = pad_permute(segment_ids.to(torch.int64), 1, layout, -1)
    out = []
    for r in range(size):
        steps, b = schedule(spec, r)
        static = plan(layout, r, spec.causal, win)[1]
        segs = (every.chunk(size, 1)[r], every)
        full = partial = 0
        for t in range(size):
            for st in steps[t]:
                mask = block_mask(spec, r, (r - t) % size, st, b, segs, every.device)
                full += mask is None
                partial += mask is not None and mask is not False
        out.append(
            BlockCounts(
                full, partial, static.full + static.partial + static.skipped - full - partial
            )
        )
    return tuple(out)

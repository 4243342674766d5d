"""Ring attention: K/V blocks travel around the axis while each rank attends to the one it holds.

Every rank keeps its queries and passes its key/value block to the next rank ``N - 1`` times, so
after ``N`` steps each query has seen every key. Each step's partial softmax is merged into a
running output with a running log-sum-exp (fp32, or the input dtype when wider), which makes
the result exact attention over the whole sequence.

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

import bisect
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import torch

from .. import _comm as raw
from .._collectives import _call
from .._mesh import Axis
from ._layouts import SeqLayout
from ._qkv import check_qkv, token_layout

__all__ = ["BlockCounts", "block_counts", "ring_attention"]

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
    """One matmul of a step: query chunk ``q`` against key rows ``[lo, hi)`` of the block."""

    q: int
    lo: int
    hi: int
    masked: bool


def _bounds(local: int, chunks: int) -> tuple[int, ...]:
    return tuple(local * i // chunks for i in range(chunks + 1))


def _chunks(layout: SeqLayout, causal: bool) -> int:
    return 2 if causal and layout.local_length % 2 == 0 and layout.local_length else 1


def _classify(qs: tuple[int, ...], ks: tuple[int, ...], length: int, causal: bool) -> str:
    """``"skip"``, ``"full"`` or ``"partial"`` for sorted query and key positions."""
    nq, nk = bisect.bisect_left(qs, length), bisect.bisect_left(ks, length)  # real tokens
    if not nq or not nk or (causal and ks[0] > qs[nq - 1]):
        return "skip"
    if nq == len(qs) and nk == len(ks) and (not causal or ks[-1] <= qs[0]):
        return "full"
    return "partial"


@functools.lru_cache(maxsize=256)
def _plan(
    kind: str, length: int, size: int, rank: int, causal: bool
) -> tuple[tuple[tuple[_Step, ...], ...], BlockCounts]:
    """For each ring step ``t`` (holding the block of rank ``(rank - t) % size``), the matmuls
    to run; and the pair counts."""
    layout = SeqLayout(kind, length, size)
    b = _bounds(layout.local_length, _chunks(layout, causal))
    mine = layout.positions(rank)
    counts = {"full": 0, "partial": 0, "skip": 0}
    steps = []
    for t in range(size):
        theirs = layout.positions((rank - t) % size)
        step = []
        for a in range(len(b) - 1):
            qs = mine[b[a] : b[a + 1]]
            kinds = [
                _classify(qs, theirs[b[j] : b[j + 1]], length, causal) for j in range(len(b) - 1)
            ]
            for x in kinds:
                counts[x] += 1
            used = [j for j, x in enumerate(kinds) if x != "skip"]
            if used:  # with two chunks, the used ones are always one range
                masked = any(kinds[j] == "partial" for j in used)
                step.append(_Step(a, b[used[0]], b[used[-1] + 1], masked))
        steps.append(tuple(step))
    return tuple(steps), BlockCounts(counts["full"], counts["partial"], counts["skip"])


def block_counts(kind: str, length: int, size: int, causal: bool) -> tuple[BlockCounts, ...]:
    """Per-rank :class:`BlockCounts` of ``ring_attention`` for a sequence of ``length`` tokens
    laid out by ``kind`` on ``size`` ranks (the schedule the kernel runs).

    Example:
        >>> from pshard.sequence._ring import block_counts
        >>> [c.work for c in block_counts("contiguous", 8, 2, causal=True)]
        [2.0, 6.0]
        >>> [c.work for c in block_counts("zigzag", 8, 2, causal=True)]
        [4.0, 4.0]
    """
    return tuple(_plan(kind, length, size, r, bool(causal))[1] for r in range(size))


# --------------------------------------------------------------------------- the kernel


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything the kernel needs besides the tensors (hashable, no tensors)."""

    layout: SeqLayout
    causal: bool
    scale: float
    groups: int  # query heads per key/value head


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _mask(spec: _Spec, rank: int, src: int, q: tuple[int, int], k: tuple[int, int], device) -> Any:
    """Boolean ``(lq, lk)``: which keys each query may see."""
    lay = spec.layout
    qp = lay.position_tensor(rank, device)[q[0] : q[1]]
    kp = lay.position_tensor(src, device)[k[0] : k[1]]
    ok = (qp < lay.length).unsqueeze(-1) & (kp < lay.length)
    if spec.causal:
        ok = ok & (kp <= qp.unsqueeze(-1))
    return ok


def _scores(qa, kb, mask, spec: _Spec, acc) -> torch.Tensor:
    """Scaled scores ``(..., hkv, g * lq, lk)`` in ``acc``, masked entries ``-inf``."""
    s = torch.matmul(qa, kb.transpose(-1, -2)).to(acc) * spec.scale
    if mask is not None:
        shape = s.shape
        s = s.unflatten(-2, (spec.groups, -1)).masked_fill(~mask, -math.inf).reshape(shape)
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see no key) as 0, so ``exp(-inf - 0) = 0``."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _fold(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``(..., hkv, g, L, d)`` -> rows ``[lo, hi)`` as ``(..., hkv, g * (hi - lo), d)``."""
    return x[..., lo:hi, :].flatten(-3, -2)


def _unfold(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    return torch.cat([p.unflatten(-2, (groups, -1)) for p in parts], -2)


def _ring_forward(q, k, v, c: raw.Comm, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``: ``(..., hkv, g, L, d)``; ``k``, ``v``: ``(..., hkv, L, d)``. Returns ``out``
    ``(..., hkv, g, L, dv)`` in q's dtype and ``lse`` ``(..., hkv, g, L)`` in the acc dtype."""
    acc, n, r, dk = _acc(q.dtype), c.size, c.rank, k.shape[-1]
    steps, _ = _plan(spec.layout.kind, spec.layout.length, n, r, spec.causal)
    b = _bounds(spec.layout.local_length, _chunks(spec.layout, spec.causal))
    qs = [_fold(q, b[a], b[a + 1]) for a in range(len(b) - 1)]
    outs = [q.new_zeros((*x.shape[:-1], v.shape[-1]), dtype=acc) for x in qs]
    lses = [q.new_full(x.shape[:-1], -math.inf, dtype=acc) for x in qs]
    perm = tuple((i, (i + 1) % n) for i in range(n))
    kv = torch.cat([k, v], -1) if n > 1 else None
    for t in range(n):
        src = (r - t) % n
        kb, vb = (k, v) if t == 0 else kv.split([dk, kv.shape[-1] - dk], -1)
        # The next block travels while this one is computed against.
        nxt, pending = raw.ppermute_start(kv, c, perm) if t < n - 1 else (None, [])
        for st in steps[t]:
            mask = (
                _mask(spec, r, src, (b[st.q], b[st.q + 1]), (st.lo, st.hi), q.device)
                if st.masked
                else None
            )
            s = _scores(qs[st.q], kb[..., st.lo : st.hi, :], mask, spec, acc)
            lse_b = torch.logsumexp(s, -1)
            p = torch.exp(s - _finite(lse_b).unsqueeze(-1))
            o_b = torch.matmul(p.to(v.dtype), vb[..., st.lo : st.hi, :]).to(acc)
            lse = torch.logaddexp(lses[st.q], lse_b)
            base = _finite(lse)
            outs[st.q] = outs[st.q] * torch.exp(lses[st.q] - base).unsqueeze(-1) + o_b * torch.exp(
                lse_b - base
            ).unsqueeze(-1)
            lses[st.q] = lse
        raw.wait(pending)
        kv = nxt
    out = _unfold(outs, spec.groups).to(q.dtype)
    return out, torch.cat([x.unflatten(-1, (spec.groups, -1)) for x in lses], -1)


def _ring_backward(q, k, v, out, lse, dout, c: raw.Comm, spec: _Spec):
    acc, n, r, dk = _acc(q.dtype), c.size, c.rank, k.shape[-1]
    steps, _ = _plan(spec.layout.kind, spec.layout.length, n, r, spec.causal)
    b = _bounds(spec.layout.local_length, _chunks(spec.layout, spec.causal))
    chunks = range(len(b) - 1)
    qs = [_fold(q, b[a], b[a + 1]).to(acc) for a in chunks]
    dos = [_fold(dout, b[a], b[a + 1]).to(acc) for a in chunks]
    lses = [_finite(lse[..., b[a] : b[a + 1]].flatten(-2)) for a in chunks]
    deltas = [
        (do * _fold(out, b[a], b[a + 1]).to(acc)).sum(-1) for a, do in zip(chunks, dos, strict=True)
    ]
    dqs = [torch.zeros_like(x) for x in qs]
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
        dkv = torch.zeros_like(kv)
        for st in steps[t]:
            mask = (
                _mask(spec, r, src, (b[st.q], b[st.q + 1]), (st.lo, st.hi), q.device)
                if st.masked
                else None
            )
            kr, vr = kb[..., st.lo : st.hi, :], vb[..., st.lo : st.hi, :]
            p = torch.exp(_scores(qs[st.q], kr, mask, spec, acc) - lses[st.q].unsqueeze(-1))
            dp = torch.matmul(dos[st.q], vr.transpose(-1, -2))
            ds = p * (dp - deltas[st.q].unsqueeze(-1)) * spec.scale
            dqs[st.q] += torch.matmul(ds, kr)
            dkv[..., st.lo : st.hi, :dk] += torch.matmul(ds.transpose(-1, -2), qs[st.q])
            dkv[..., st.lo : st.hi, dk:] += torch.matmul(p.transpose(-1, -2), dos[st.q])
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
    dq = _unfold(dqs, spec.groups).to(q.dtype)
    dkb, dvb = dkv.split([dk, dkv.shape[-1] - dk], -1)
    return dq, dkb.to(k.dtype), dvb.to(v.dtype)


class _Ring(torch.autograd.Function):
    """Forward ``(out, lse)``; backward through :class:`_RingGrad`."""

    @staticmethod
    def forward(q, k, v, c: raw.Comm, spec: _Spec):  # type: ignore[override]
        return _ring_forward(q, k, v, c, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, c, spec = inputs
        out, lse = output
        ctx.c, ctx.spec = c, spec
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _call(_RingGrad, q, k, v, out, lse, dout, ctx.c, ctx.spec)
        return dq, dk, dv, None, None

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
    def forward(q, k, v, out, lse, dout, c: raw.Comm, spec: _Spec):  # type: ignore[override]
        return _ring_backward(q, k, v, out, lse, dout, c, spec)

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
        seq_dim: the sequence dim of ``q``, ``k``, ``v``.
        head_dim: the head dim.
        scale: the softmax scale (default ``1 / sqrt(head_size)``).

    Returns:
        This rank's shard of the attention output (``q``'s shape with ``v``'s head size, ``q``'s
        dtype).

    Raises:
        ValueError: the key/value heads do not divide the query heads, the shapes disagree, or
            the local length is not the one ``shard_map_seq`` gave this rank.
        TypeError: q, k, v are not tensors of one floating dtype.

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
    sd, hd, hq, hkv = check_qkv(_FN, q, k, v, seq_dim, head_dim, one_dtype=True)
    c = raw.comm(axis, _FN)
    layout = token_layout(_FN, axis, c.size, q, sd)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    spec = _Spec(layout, bool(causal), float(scale), hq // hkv)
    qt = q.movedim((hd, sd), (-3, -2)).unflatten(-3, (hkv, hq // hkv))
    kt, vt = (t.movedim((hd, sd), (-3, -2)) for t in (k, v))
    out, _ = _call(_Ring, qt, kt, vt, c, spec)
    return out.flatten(-4, -3).movedim((-3, -2), (hd, sd))

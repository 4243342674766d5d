"""The ring pass: key/value blocks travel around the axis while each rank attends to the one it
holds, forward and backward, and the ``torch.autograd.Function`` that differentiates it.

Forward (:func:`ring_forward`): every rank keeps its queries and passes its key/value block to
the next rank ``N - 1`` times (the next block travels while the current one is computed
against), so after ``N`` steps each query has seen every key. Each step runs the blocks the
schedule planned (:mod:`._ring_schedule`) and merges them into a running output
(:func:`pshard.sequence._ring_blocks.merge`), which makes the result exact attention over the
whole sequence. It returns the output and the log-sum-exp.

Backward (:func:`ring_backward`): from the saved ``(q, k, v, out, lse)`` alone, each block's
probabilities are recomputed, and the fp32 key/value gradients travel around the ring with the
blocks, so they arrive at their owner after ``N`` hops. Memory per rank is ``O(s / N)`` saved
activations plus one block of scores at a time.

:class:`Ring` (``setup_context`` style, so ``torch.func.grad`` works) saves only those tensors
and runs the backward as a Function of its own (:class:`RingGrad`), so that differentiating it
again, forward-mode differentiation and ``vmap`` raise instead of silently missing the
communication.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._collectives.apply import call
from .._runtime import wire as raw
from ._kernels import block_kernel, finite
from ._ring_blocks import acc_dtype, block_backward, block_forward, fold, merge, unfold
from ._ring_schedule import RingSpec, Segments, block_kind, schedule

__all__ = ["Ring", "ring_backward", "ring_forward"]

_FN = "ring_attention"


def _next(n: int) -> tuple[tuple[int, int], ...]:
    """The ring's permutation: index ``i`` sends to ``i + 1``."""
    return tuple((i, (i + 1) % n) for i in range(n))


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segs: Segments | None,
    c: raw.Comm,
    spec: RingSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``: ``(..., hkv, g, L, d)``; ``k``, ``v``: ``(..., hkv, L, d)``; ``segs``: ``None``
    or (this rank's segment ids ``(..., L)``, every rank's ``(..., N * L)``). Returns ``out``
    ``(..., hkv, g, L, dv)`` in q's dtype and ``lse`` ``(..., hkv, g, L)`` in the acc dtype."""
    acc, n, r, dk = acc_dtype(q.dtype), c.size, c.rank, k.shape[-1]
    kern = block_kernel(q.device, acc, max(dk, v.shape[-1]))
    steps, b = schedule(spec, r)
    qs = [fold(q, b[a], b[a + 1]) for a in range(len(b) - 1)]
    # a query chunk's first block is its running result as is; chunks that never see a key
    # are filled in at the end (zeros, log-sum-exp -inf)
    outs: list[torch.Tensor | None] = [None] * len(qs)
    lses: list[torch.Tensor | None] = [None] * len(qs)
    perm = _next(n)
    kv = torch.cat([k, v], -1) if n > 1 else None  # the block held, sent on to the next rank
    for t in range(n):
        src = (r - t) % n
        kb, vb = (k, v) if kv is None or t == 0 else kv.split([dk, kv.shape[-1] - dk], -1)
        # The next block travels while this one is computed against.
        nxt, pending = (
            raw.ppermute_start(kv, c, perm) if kv is not None and t < n - 1 else (None, [])
        )
        for st in steps[t]:
            mask, tri = block_kind(spec, r, src, st, b, segs, kern is not None, q.device)
            if mask is False:
                continue
            lo, hi = b[st.k], b[st.k + 1]
            o_b, lse_b = block_forward(
                qs[st.q], kb[..., lo:hi, :], vb[..., lo:hi, :], mask, spec, acc, kern, tri
            )
            out_a, lse_a = outs[st.q], lses[st.q]
            if out_a is None or lse_a is None:
                outs[st.q], lses[st.q] = o_b, lse_b
            else:
                outs[st.q], lses[st.q] = merge(out_a, lse_a, o_b, lse_b)
        raw.wait(pending)
        kv = nxt
    done_outs, done_lses = [], []
    for x, out_a, lse_a in zip(qs, outs, lses, strict=True):
        if out_a is None or lse_a is None:  # a chunk that sees no key
            out_a = q.new_zeros((*x.shape[:-1], v.shape[-1]), dtype=acc)
            lse_a = q.new_full(x.shape[:-1], -math.inf, dtype=acc)
        done_outs.append(out_a)
        done_lses.append(lse_a)
    out = unfold(done_outs, spec.groups).to(q.dtype)
    return out, torch.cat([x.unflatten(-1, (spec.groups, -1)) for x in done_lses], -1)


def ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    segs: Segments | None,
    c: raw.Comm,
    spec: RingSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`ring_forward` from its output and log-sum-exp."""
    acc, n, r, dk = acc_dtype(q.dtype), c.size, c.rank, k.shape[-1]
    kern = block_kernel(q.device, acc, max(dk, v.shape[-1]))
    steps, b = schedule(spec, r)
    chunks = range(len(b) - 1)
    qs = [fold(q, b[a], b[a + 1]).to(acc) for a in chunks]
    dos = [fold(dout, b[a], b[a + 1]).to(acc) for a in chunks]
    lses = [finite(lse[..., b[a] : b[a + 1]].flatten(-2)) for a in chunks]
    outs = [fold(out, b[a], b[a + 1]).to(acc) for a in chunks]
    deltas = [(do * o).sum(-1) for do, o in zip(dos, outs, strict=True)]
    dqs: list[torch.Tensor | None] = [None] * len(qs)  # a chunk's first block, then summed into
    kv = torch.cat([k, v], -1).to(acc)
    # dK/dV of the block held at step t are computed into a fresh buffer while the partial sums
    # of the block sent at step t - 1 travel; they are added on arrival and sent on, so after n
    # hops every block's gradient is back at its owner. Both transfers are issued in the same
    # order on every rank, which is what matches them.
    perm = _next(n)
    incoming: torch.Tensor | None = None
    dkv_pending: list[Any] = []
    for t in range(n):
        src = (r - t) % n
        kb, vb = kv.split([dk, kv.shape[-1] - dk], -1)
        nxt, kv_pending = raw.ppermute_start(kv, c, perm) if t < n - 1 else (kv, [])
        dkv = torch.empty_like(kv)
        written: set[int] = set()  # key chunks of dkv holding a block's gradient
        for st in steps[t]:
            mask, tri = block_kind(spec, r, src, st, b, segs, kern is not None, q.device)
            if mask is False:
                continue
            lo, hi = b[st.k], b[st.k + 1]
            a = st.q
            dq_b, dk_b, dv_b = block_backward(
                qs[a], kb[..., lo:hi, :], vb[..., lo:hi, :], dos[a], outs[a], lses[a],
                deltas[a], mask, spec, acc, kern, tri,
            )  # fmt: skip
            dq_a = dqs[a]
            dqs[a] = dq_b if dq_a is None else dq_a.add_(dq_b)
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
    assert incoming is not None  # n >= 1 steps ran
    dq = unfold(
        [torch.zeros_like(x) if g is None else g for g, x in zip(dqs, qs, strict=True)],
        spec.groups,
    ).to(q.dtype)
    dkb, dvb = incoming.split([dk, incoming.shape[-1] - dk], -1)
    return dq, dkb.to(k.dtype), dvb.to(v.dtype)


class Ring(torch.autograd.Function):
    """``(q, k, v, mine, every, c, spec)`` -> ``(out, lse)`` of :func:`ring_forward` (``mine``
    and ``every`` the segment ids, or ``None``); backward through :class:`RingGrad`."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mine: torch.Tensor | None,
        every: torch.Tensor | None,
        c: raw.Comm,
        spec: RingSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        segs = None if mine is None or every is None else (mine, every)
        return ring_forward(q, k, v, segs, c, spec)

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
        dq, dk, dv = call(RingGrad, q, k, v, out, lse, dout, mine, every, ctx.c, ctx.spec)
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


class RingGrad(torch.autograd.Function):
    """The backward of :class:`Ring` as its own Function, so that differentiating it again
    raises instead of silently missing the communication."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        mine: torch.Tensor | None,
        every: torch.Tensor | None,
        c: raw.Comm,
        spec: RingSpec,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        segs = None if mine is None or every is None else (mine, every)
        return ring_backward(q, k, v, out, lse, dout, segs, c, spec)

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

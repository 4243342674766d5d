"""``ring_attention``: exact attention over the whole sequence from this rank's sequence shard,
the key/value blocks travelling around the axis.

The rooms of ring attention, one concept each:

- :mod:`._ring_schedule`: which (query chunk, key chunk) blocks each rank computes, with which
  mask, from the tokens' global positions (pure integer math on the layout; cached);
- :mod:`._ring_blocks`: one block on explicit matmuls or a fused kernel (:mod:`._kernels`), its
  gradient, and the online softmax merge of partial results;
- :mod:`._ring_pass`: the forward and backward passes around the ring and the autograd
  Function that runs them;
- this module: the public function (argument checks, the layout of this rank's tokens, the
  segment ids of every rank) and :func:`ring_core`, which ``usp_attention`` shares.

Causal masking and padding come from the true global positions of the tokens (the sequence
context of ``shard_map_seq``; outside it, a contiguous layout without padding). Grouped-query
attention sends the key/value heads only; query heads are grouped against them locally (no
copies of K/V).
"""

from __future__ import annotations

import math

import torch

from .._collectives.apply import call
from .._runtime import wire as raw
from .._runtime.mesh import Axis
from ._context import context_scope
from ._masks import Window
from ._qkv import attention_args, token_layout
from ._ring_pass import Ring
from ._ring_schedule import RingSpec, TokenLayout

__all__ = ["ring_attention", "ring_core"]

_FN = "ring_attention"


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
    layout: TokenLayout,
    c: raw.Comm,
    causal: bool,
    window: Window | None,
    scale: float | None,
    sd: int,
    hd: int,
) -> torch.Tensor:
    """Ring attention on checked arguments: ``layout`` says where every ring rank's tokens are
    (a :class:`~pshard.sequence._ring_schedule.TokenLayout`), ``mine`` this rank's segment ids
    (sequence last) or ``None``; ``sd``, ``hd`` the normalised sequence and head dims."""
    hq, hkv = q.shape[hd], k.shape[hd]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    spec = RingSpec(layout, causal, float(scale), hq // hkv, window)
    every = None
    if mine is not None:
        every = raw.all_gather(mine, c, mine.dim() - 1, True) if c.size > 1 else mine
    qt = q.movedim((hd, sd), (-3, -2)).unflatten(-3, (hkv, hq // hkv))
    kt, vt = (t.movedim((hd, sd), (-3, -2)) for t in (k, v))
    out, _ = call(Ring, qt, kt, vt, mine, every, c, spec)
    return out.flatten(-4, -3).movedim((-3, -2), (hd, sd))

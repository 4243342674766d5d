"""Hybrid sequence parallelism over two axes: Ulysses inside, ring across (``usp_attention``).

The sequence is split over the product of ``ring_axis`` (major) and ``ulysses_axis`` (minor) by
``shard_map_seq(axis=(ring_axis, ulysses_axis))``. An all-to-all over ``ulysses_axis`` gives each
rank every token of its Ulysses group for ``heads / U`` heads; ring attention over ``ring_axis``
then runs on those heads, each ring rank holding its group's tokens
(:class:`~pshard.sequence._ring_schedule.GatheredLayout`: the concatenation of the group's
positions, so causal masks, padding, segment ids and windows stay exact by global position under
every layout); a second all-to-all returns this rank's tokens with every head.

With ``N = R * U`` ranks, per rank and layer (counted by ``benchmarks/sequence_parallel.py``):
the Ulysses part moves ``(U - 1) / U`` of q, k, v and the output of its ``s / N`` tokens, the ring
part sends the K/V of ``s / R`` tokens of ``h_kv / U`` heads ``R - 1`` times, that is
``2 (R - 1) / R * s * h_kv * d / U`` elements forward. So the ring's bytes fall by ``U`` against
pure ring attention on ``N`` ranks, and the heads need only divide by ``U``.
"""

from __future__ import annotations

import torch

from .._runtime import wire as raw
from .._runtime.mesh import Axis
from ._context import context_scope, normalize_axis
from ._heads import heads_to_seq, seq_to_heads
from ._qkv import attention_args, repeat_kv, token_layout
from ._ring import ring_core
from ._ring_schedule import GatheredLayout

__all__ = ["usp_attention"]

_FN = "usp_attention"


def _to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, n: int, sd: int, hd: int
) -> tuple[torch.Tensor, ...]:
    """``seq_to_heads`` of q, k, v over ``axis`` (``n`` ranks); one all-to-all when they can be
    packed together."""
    hq, hkv = q.shape[hd], k.shape[hd]
    if q.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype and q.device == k.device:
        # per rank r: [q heads of r | k heads of r | v heads of r], then one exchange
        parts = [t.unflatten(hd, (n, -1)) for t in (q, k, v)]
        packed = torch.cat(parts, hd + 1).flatten(hd, hd + 1)
        both = seq_to_heads(packed, axis, seq_dim=sd, head_dim=hd)
        return both.split([hq // n, hkv // n, hkv // n], hd)
    return tuple(seq_to_heads(t, axis, seq_dim=sd, head_dim=hd) for t in (q, k, v))


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_axis: Axis,
    ring_axis: Axis,
    causal: bool = False,
    segment_ids: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_dim: int = 1,
    head_dim: int = 2,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence, Ulysses over ``ulysses_axis`` and ring attention
    over ``ring_axis`` (Unified Sequence Parallelism).

    Use it inside ``shard_map_seq(axis=(ring_axis, ulysses_axis))``: each rank passes its tokens
    of ``q``, ``k``, ``v`` with every head. In pseudo-code, with ``U`` and ``R`` the axis sizes::

        qh, kh, vh = seq_to_heads((q, k, v), ulysses_axis)  # U * L tokens, heads / U heads
        oh = ring_attention(qh, kh, vh, ring_axis)           # the group's tokens around the ring
        return heads_to_seq(oh, ulysses_axis)                # this rank's tokens, all heads

    The masks are those of :func:`pshard.ring_attention` (``causal``, ``segment_ids``,
    ``window``, padding), by global position under every layout; blocks they empty are skipped.
    The query heads must divide by ``U`` (not by ``R * U``): this is how a sequence uses more
    ranks than there are heads. With fewer key/value heads than ``U`` (GQA) each is repeated
    ``U / gcd(h_kv, U)`` times, as in :func:`pshard.ulysses_attention`. Gradients: reverse mode
    (``.backward()``, ``torch.func.grad``, ``vjp``), as for ring attention.

    Args:
        q, k, v: this rank's shard, ``(batch, seq, heads, head_size)`` by default.
        ulysses_axis: the axis of the all-to-all (typically inside a node).
        ring_axis: the axis of the ring (typically across nodes).
        causal: causal masking by global position.
        segment_ids: this rank's segment id of every token (``(batch, seq)`` by default).
        window: a sliding window on global positions, ``w`` or ``(left, right)``.
        seq_dim: the sequence dim of ``q``, ``k``, ``v``.
        head_dim: the head dim.
        scale: the softmax scale (default ``1 / sqrt(head_size)``).

    Returns:
        This rank's shard of the attention output.

    Raises:
        ValueError: the query heads do not divide by the Ulysses axis size, the shapes disagree,
            or the local length is not the one ``shard_map_seq`` gave this rank.
        TypeError: q, k, v are not tensors of one floating dtype, or ``segment_ids`` is not an
            integer tensor.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"ring": 1, "uly": 1})
        >>> q, k, v = torch.randn(3, 2, 5, 4, 8).unbind(0)
        >>> out = ps.usp_attention(q, k, v, ulysses_axis="uly", ring_axis="ring", causal=True)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        >>> torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
        True
    """
    outer, inner = normalize_axis(ring_axis), normalize_axis(ulysses_axis)
    both = (*outer, *inner) if isinstance(outer, tuple) and isinstance(inner, tuple) else None
    a = attention_args(_FN, q, k, v, both, seq_dim, head_dim, segment_ids, window)
    sd, hd, hq, seg = a.sd, a.hd, a.hq, a.segments
    with context_scope(a.ctx):
        cu, cr = raw.comm(ulysses_axis, _FN), raw.comm(ring_axis, _FN)
        u, r = cu.size, cr.size
        if hq % u:
            raise ValueError(
                f"{_FN}: q has {hq} heads (head_dim={hd}, shape {tuple(q.shape)}), which do "
                f"not divide by the size {u} of ulysses_axis {cu.name!r}; the Ulysses part "
                f"gives every rank heads / {u} query heads"
            )
        layout = token_layout(_FN, a.ctx, r * u, q, sd)
        k, v = repeat_kv(k, v, u, hd)
        qh, kh, vh = _to_heads(q, k, v, ulysses_axis, u, sd, hd)
        if seg is not None and u > 1:
            seg = raw.all_gather(seg, cu, seg.dim() - 1, True)  # the group's tokens, in order
        gathered = GatheredLayout(layout, r, u)
        out = ring_core(qh, kh, vh, seg, gathered, cr, bool(causal), a.window, scale, sd, hd)
        return heads_to_seq(out, ulysses_axis, seq_dim=sd, head_dim=hd)

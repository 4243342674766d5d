"""Ulysses attention: all-to-all to head-sharded tensors, exact attention over the whole
sequence, all-to-all back.

Under any layout the all-to-all hands each rank every token of its heads in the *permuted* order
(every rank's tokens in rank order). Rather than masking by position in that order (a dense
``seq x seq`` mask, too big for the long sequences sequence parallelism is for), the tokens are
put back in sequence order and the padding is dropped as they leave the all-to-all's receive
buffer (:mod:`pshard.sequence._exchange`: strided copies, no index tensors), so the attention
itself is plain full or causal attention over the true sequence, and any fast kernel applies.
The output is padded and permuted back as it enters the second all-to-all's send buffer;
padded tokens get zeros and never act as keys.

Segment ids and sliding windows (:mod:`pshard.sequence._masks`) need a mask over the whole
sequence: the ids of every token are gathered once per call (one small all-gather of ints),
and ``attn_fn`` gets a boolean ``(batch..., 1, seq, seq)`` ``attn_mask`` in sequence order.
Queries that see no key get one dummy visible key and a zeroed output, so no kernel ever sees a
fully masked row (some return NaN for those) and their gradient is exactly 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._runtime import wire as raw
from .._runtime.mesh import Axis
from ._context import context_scope
from ._exchange import heads_to_tokens, tokens_to_heads
from ._layouts import SeqLayout, unpermute_unpad
from ._masks import Window, position_mask, segment_mask
from ._qkv import AttentionArgs, attention_args, repeat_kv, token_layout

__all__ = ["ulysses_attention"]

_FN = "ulysses_attention"


def _takes_mask(attn_fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(attn_fn).parameters.values()
    except (TypeError, ValueError):  # cannot tell: calling it will say
        return True
    return any(p.name == "attn_mask" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _mask(
    seg: torch.Tensor | None,
    layout: SeqLayout,
    causal: bool,
    window: Window | None,
    axis: Axis,
    device: torch.device,
) -> torch.Tensor:
    """Boolean ``(batch..., 1, seq, seq)`` (or ``(seq, seq)``) over the true sequence in
    sequence order: who sees whom by position and segment."""
    pos = torch.arange(layout.length, device=device)
    mask = position_mask(pos, pos, layout.length, causal, window)
    if seg is not None:
        c = raw.comm(axis, _FN)
        every = raw.all_gather(seg, c, seg.dim() - 1, True) if c.size > 1 else seg
        every = unpermute_unpad(every, every.dim() - 1, layout)
        mask = (mask & segment_mask(every, every)).unsqueeze(-3)
    return mask


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: Axis = "sp",
    causal: bool = False,
    segment_ids: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    attn_fn: Callable[..., torch.Tensor] | None = None,
    seq_dim: int = 1,
    head_dim: int = 2,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence from this rank's sequence shard (Ulysses).

    Each rank passes its tokens of ``q``, ``k``, ``v`` with all heads; an all-to-all gives every
    rank all tokens of ``heads / N`` heads; attention runs over the whole sequence; a second
    all-to-all returns this rank's tokens with all heads. In pseudo-code, on ``N`` ranks::

        q_all, k_all, v_all = gather_sequence(q, k, v)  # this rank's heads, every token
        out_all = attn_fn(q_all, k_all, v_all, is_causal=causal, scale=scale)
        return my_tokens(out_all)                      # all heads

    Inside ``shard_map_seq`` it knows the layout: ``causal=True`` masks by the true global
    positions under every layout (contiguous, zigzag, stripe), and padding tokens are never
    attended to. Outside, the tokens are taken to be contiguous and unpadded (rank ``r`` holds
    ``[r * L, (r + 1) * L)``).

    Masks (global positions, every layout): ``segment_ids`` restricts each query to the keys of
    its own segment (packed documents; a negative id sees and is seen by nothing), ``window``
    to a sliding window (``w``: Hugging Face's ``sliding_window``, query ``i`` sees key ``j``
    when ``i - w < j``; ``(left, right)``: ``i - left <= j <= i + right``, ``None`` or ``-1``
    for an unbounded side). Both combine with ``causal``. A query that sees no key outputs 0
    and gets 0 gradient. With either, ``attn_fn`` is given a boolean ``attn_mask`` over the
    whole sequence (``True``: may attend), so it must take one.

    Under activation checkpointing (``torch.utils.checkpoint``, reentrant or not) the
    recomputation in the backward pass uses the layout recorded by the forward's
    ``shard_map_seq``, so checkpointed layers give the same numbers.

    Grouped-query attention: ``k``/``v`` may have fewer heads than ``q`` (a divisor of them).
    When their heads do not divide by ``N``, each is repeated just enough (``N / gcd(heads,
    N)`` times) for every rank to receive the key/value heads its query heads use; the
    gradients of the copies are summed back into ``k`` and ``v``.

    Args:
        q, k, v: this rank's shard, ``(batch, seq, heads, head_size)`` by default (``seq_dim``,
            ``head_dim`` say otherwise; the last dim is always the head size). ``v`` may have
            another head size.
        axis: the sequence-parallel mesh axis.
        causal: causal masking by global position.
        segment_ids: this rank's segment id of every token, an integer tensor of ``q``'s shape
            without the head and feature dims (``(batch, seq)`` by default).
        window: a sliding window on global positions, ``w`` or ``(left, right)``.
        attn_fn: the attention over the whole sequence, called as
            ``attn_fn(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` on
            ``(batch, heads / N, seq, head_size)`` tensors in sequence order with the padding
            removed (so causal attention needs no mask); ``enable_gqa`` is ``True`` when ``k``,
            ``v`` have fewer heads than ``q``. With ``segment_ids`` or ``window`` it is called
            with ``attn_mask=`` (boolean, ``(batch, 1, seq, seq)``) and ``is_causal=False``.
            Default: ``torch.nn.functional.scaled_dot_product_attention`` (whose signature
            this is); wrap ``flex_attention`` to use it.
        seq_dim: the sequence dim of ``q``, ``k``, ``v``.
        head_dim: the head dim.
        scale: the softmax scale (default ``1 / sqrt(head_size)``).

    Returns:
        This rank's shard of the attention output (``q``'s shape with ``v``'s head size).

    Raises:
        ValueError: the query heads do not divide by the axis size, the key/value heads do not
            divide the query heads, the shapes disagree, the local length is not the one
            ``shard_map_seq`` gave this rank, a window is malformed, or a mask is asked for
            with an ``attn_fn`` that takes no ``attn_mask``.
        TypeError: ``segment_ids`` is not an integer tensor.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> q, k, v = torch.randn(3, 2, 5, 4, 8).unbind(0)        # (batch, seq, heads, size)
        >>> out = ps.ulysses_attention(q, k, v, causal=True)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        >>> torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
        True
    """
    a = attention_args(_FN, q, k, v, axis, seq_dim, head_dim, segment_ids, window)
    masked = a.segments is not None or a.window is not None
    if attn_fn is not None and masked and not _takes_mask(attn_fn):
        given = " and ".join(
            name for name, x in (("segment_ids", a.segments), ("window", a.window)) if x is not None
        )
        raise ValueError(
            f"{_FN}: {given} needs a mask, but attn_fn "
            f"{getattr(attn_fn, '__name__', attn_fn)!r} takes no attn_mask argument; give "
            f"attn_fn an attn_mask parameter (a boolean (batch, 1, seq, seq) mask, True where "
            f"a query may attend), or leave attn_fn unset"
        )
    with context_scope(a.ctx):
        return _ulysses(q, k, v, axis, bool(causal), attn_fn, scale, a)


def _ulysses(q, k, v, axis, causal, attn_fn, scale, a: AttentionArgs):
    sd, hd, hq, hkv, win, seg, ctx = a
    c = raw.comm(axis, _FN)
    n = c.size
    if hq % n:
        raise ValueError(
            f"{_FN}: q has {hq} heads (head_dim={hd}, shape {tuple(q.shape)}), which do not "
            f"divide by the size {n} of axis {c.name!r}; Ulysses attention gives every rank "
            f"heads / {n} query heads: use a head count divisible by {n}, or a smaller axis"
        )
    layout = token_layout(_FN, ctx, n, q, sd)
    if attn_fn is None:
        attn_fn = F.scaled_dot_product_attention
    k, v = repeat_kv(k, v, n, hd)
    # (..., heads / N, seq, size) in sequence order, padding dropped
    qh, kh, vh = tokens_to_heads(layout, c, sd, hd, q, k, v)
    gqa = hq != k.shape[hd]
    if layout.length and (seg is not None or win is not None):
        mask = _mask(seg, layout, causal, win, axis, q.device)
        seen = mask.any(-1, keepdim=True)  # queries that see at least one key
        out = attn_fn(
            qh, kh, vh, attn_mask=mask | ~seen, is_causal=False, scale=scale, enable_gqa=gqa
        )
        out = torch.where(seen, out, out.new_zeros(()))
    elif layout.length:
        out = attn_fn(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=gqa)
    else:  # an empty sequence: nothing to attend to
        out = qh.new_zeros((*qh.shape[:-1], vh.shape[-1]))
    return heads_to_tokens(layout, c, sd, hd, out)[0]

"""Ulysses attention: all-to-all to head-sharded tensors, exact attention over the whole
sequence, all-to-all back.

Under any layout the all-to-all hands each rank every token of its heads in the *permuted* order
(every rank's tokens in rank order). Rather than masking by position in that order (a dense
``seq x seq`` mask, too big for the long sequences sequence parallelism is for), the tokens are
put back in sequence order and the padding is dropped (one ``index_select``, or nothing for an
unpadded contiguous layout), so the attention itself is plain full or causal attention over the
true sequence, and any fast kernel applies. The output is padded and permuted back before the
second all-to-all; padded tokens get zeros and never act as keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .._mesh import Axis, resolve_axis
from ._heads import heads_to_seq, seq_to_heads
from ._layouts import pad_permute, unpermute_unpad
from ._qkv import check_qkv, token_layout

__all__ = ["ulysses_attention"]

_FN = "ulysses_attention"


def _exchange(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, n: int, sd: int, hd: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seq_to_heads`` of q, k, v; one all-to-all when they can be packed together."""
    hq, hkv = q.shape[hd], k.shape[hd]
    if q.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype and q.device == k.device:
        # per rank r: [q heads of r | k heads of r | v heads of r], then one exchange
        parts = [t.unflatten(hd, (n, -1)) for t in (q, k, v)]
        packed = torch.cat(parts, hd + 1).flatten(hd, hd + 1)
        both = seq_to_heads(packed, axis, seq_dim=sd, head_dim=hd)
        return both.split([hq // n, hkv // n, hkv // n], hd)  # type: ignore[return-value]
    return tuple(seq_to_heads(t, axis, seq_dim=sd, head_dim=hd) for t in (q, k, v))  # type: ignore[return-value]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    axis: Axis = "sp",
    causal: bool = False,
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
        attn_fn: the attention over the whole sequence, called as
            ``attn_fn(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` on
            ``(batch, heads / N, seq, head_size)`` tensors in sequence order with the padding
            removed (so no mask is needed); ``enable_gqa`` is ``True`` when ``k``, ``v`` have
            fewer heads than ``q``. Default: ``torch.nn.functional.scaled_dot_product_attention``
            (whose signature this is); wrap ``flex_attention`` to use it.
        seq_dim: the sequence dim of ``q``, ``k``, ``v``.
        head_dim: the head dim.
        scale: the softmax scale (default ``1 / sqrt(head_size)``).

    Returns:
        This rank's shard of the attention output (``q``'s shape with ``v``'s head size).

    Raises:
        ValueError: the query heads do not divide by the axis size, the key/value heads do not
            divide the query heads, the shapes disagree, or the local length is not the one
            ``shard_map_seq`` gave this rank.

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
    sd, hd, hq, hkv = check_qkv(_FN, q, k, v, seq_dim, head_dim)
    info = resolve_axis(axis, fn=_FN)
    n = info.size
    if hq % n:
        raise ValueError(
            f"{_FN}: q has {hq} heads (head_dim={hd}, shape {tuple(q.shape)}), which do not "
            f"divide by the size {n} of axis {info.name!r}; Ulysses attention gives every rank "
            f"heads / {n} query heads: use a head count divisible by {n}, or a smaller axis"
        )
    layout = token_layout(_FN, axis, n, q, sd)
    if attn_fn is None:
        attn_fn = F.scaled_dot_product_attention
    copies = n // math.gcd(hkv, n)
    if copies > 1:
        k = k.repeat_interleave(copies, dim=hd)
        v = v.repeat_interleave(copies, dim=hd)
    qh, kh, vh = _exchange(q, k, v, axis, n, sd, hd)
    # (..., heads / N, padded seq in permuted order, size) -> sequence order, padding dropped
    qh, kh, vh = (unpermute_unpad(t.movedim((hd, sd), (-3, -2)), -2, layout) for t in (qh, kh, vh))
    if layout.length:
        out = attn_fn(
            qh, kh, vh, is_causal=bool(causal), scale=scale, enable_gqa=hq != hkv * copies
        )
    else:  # an empty sequence: nothing to attend to
        out = qh.new_zeros((*qh.shape[:-1], vh.shape[-1]))
    out = pad_permute(out, out.dim() - 2, layout, 0.0).movedim((-3, -2), (hd, sd))
    return heads_to_seq(out, axis, seq_dim=sd, head_dim=hd)

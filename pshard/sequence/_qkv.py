"""Argument checks shared by the sequence-parallel attention functions: the q, k, v shapes, the
masks, the sequence context, the layout of this rank's tokens (from the ``shard_map_seq``
context, else contiguous) and the key/value heads repeated for an all-to-all."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .._core.checks import normalize_dim
from .._core.tree import describe
from ._context import SeqContext, find_context
from ._layouts import SeqLayout
from ._masks import Window, check_segment_ids, check_window


def _dim(fn: str, name: str, d: Any, q: torch.Tensor) -> int:
    d = normalize_dim(fn, name, d, q, what="q")
    if d == q.dim() - 1:
        raise ValueError(
            f"{fn}: {name}={d} names the last dim of q (shape {tuple(q.shape)}), which is the "
            f"feature (head size) dim; q, k, v are (batch..., seq, heads, head_size) by default"
        )
    return d


def check_qkv(
    fn: str, q: Any, k: Any, v: Any, seq_dim: Any, head_dim: Any, *, one_dtype: bool = False
) -> tuple[int, int, int, int]:
    """Validate q, k, v (``(..., seq, heads, head_size)`` with ``seq_dim``/``head_dim`` saying
    where) and return ``(seq_dim, head_dim, query heads, key/value heads)``, dims normalised."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise TypeError(
                f"{fn}: {name} must be a tensor with at least 3 dims (seq, heads, head_size), "
                f"got {describe(t)}"
            )
    shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(f"{fn}: q, k, v must have the same number of dims, got shapes {shapes}")
    if one_dtype and (not q.dtype == k.dtype == v.dtype or not q.is_floating_point()):
        raise TypeError(
            f"{fn}: q, k, v must have one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    sd, hd = _dim(fn, "seq_dim", seq_dim, q), _dim(fn, "head_dim", head_dim, q)
    if sd == hd:
        raise ValueError(f"{fn}: seq_dim={seq_dim} and head_dim={head_dim} name the same dim")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{fn}: k and v must agree on every dim but the last, got shapes {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{fn}: q and k must have the same head size (last dim), got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    others = [d for d in range(q.dim() - 1) if d != hd]
    if [q.shape[d] for d in others] != [k.shape[d] for d in others]:
        raise ValueError(
            f"{fn}: q and k must agree on every dim but the head dim ({hd}) and the last, got "
            f"shapes {tuple(q.shape)} and {tuple(k.shape)}"
        )
    hq, hkv = q.shape[hd], k.shape[hd]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{fn}: q has {hq} heads and k, v have {hkv} (head_dim={hd}); the query heads must "
            f"be a multiple of the key/value heads (grouped-query attention)"
        )
    return sd, hd, hq, hkv


def token_layout(fn: str, ctx: SeqContext | None, n: int, q: torch.Tensor, sd: int) -> SeqLayout:
    """The layout of this rank's tokens: the ``shard_map_seq`` context's (checked against q's
    length), else a contiguous sequence of ``n`` equal shards without padding."""
    local = q.shape[sd]
    if ctx is None:
        return SeqLayout("contiguous", n * local, n)
    lay = ctx.layout
    if local != lay.local_length or lay.size != n:
        raise ValueError(
            f"{fn}: q has {local} tokens along seq_dim={sd} (shape {tuple(q.shape)}) but "
            f"shard_map_seq gave this rank {lay.local_length} (a sequence of {lay.length} on "
            f"{lay.size} ranks, {lay.kind} layout); pass this rank's tokens, with seq_dim naming "
            f"their dim"
        )
    return lay


class AttentionArgs(NamedTuple):
    """The checked arguments of an attention call: dims, head counts, masks and context."""

    sd: int
    hd: int
    hq: int
    hkv: int
    window: Window | None
    segments: torch.Tensor | None  # this rank's ids, sequence last
    ctx: SeqContext | None


def attention_args(
    fn: str, q: Any, k: Any, v: Any, axis: Any, seq_dim: Any, head_dim: Any, segment_ids: Any,
    window: Any,
) -> AttentionArgs:  # fmt: skip
    """Check q, k, v (one floating dtype), the window and the segment ids; find the sequence
    context of ``axis`` (``None`` for any) and count this call in it."""
    sd, hd, hq, hkv = check_qkv(fn, q, k, v, seq_dim, head_dim, one_dtype=True)
    win = check_window(fn, window)
    seg = None if segment_ids is None else check_segment_ids(fn, segment_ids, q, sd, hd)
    ctx = find_context(axis, q.shape[sd])
    if ctx is not None:
        ctx.attended()
    return AttentionArgs(sd, hd, hq, hkv, win, seg, ctx)


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n: int, hd: int) -> tuple[torch.Tensor, ...]:
    """``k``, ``v`` with each head repeated just enough (``n / gcd(heads, n)`` times) for every
    rank of an all-to-all over ``n`` ranks to receive the key/value heads its query heads use;
    the gradients of the copies are summed back by autograd."""
    copies = n // math.gcd(k.shape[hd], n)
    if copies == 1:
        return k, v
    return k.repeat_interleave(copies, dim=hd), v.repeat_interleave(copies, dim=hd)

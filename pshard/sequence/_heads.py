"""The Ulysses all-to-alls: from sequence-sharded to head-sharded tensors and back.

``seq_to_heads`` gathers the sequence and scatters the heads: each rank goes from its own tokens
with every head to every token with its own heads. ``heads_to_seq`` is its exact inverse (and
transpose). Both are one differentiable :func:`pshard.all_to_all`, so they compose with
``torch.func`` and ``.backward()`` like every pshard collective.

The fused-QKV form (``num_packed=3``): the head dim packs several groups of heads one after the
other (``[q heads | k heads | v heads]``); each rank gets its share of *every* group, still
packed group by group, in one all-to-all.

When the sequence was padded at its end to a multiple of the axis size (the ``"contiguous"``
layout), ``seq_len`` trims the gathered sequence back to its true length after
``seq_to_heads`` and pads it again (with zeros) before ``heads_to_seq``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._collectives.functions import all_to_all
from .._core.checks import check_int, normalize_dim
from .._core.tree import describe
from .._runtime.mesh import Axis, resolve_axis

__all__ = ["seq_to_heads", "heads_to_seq"]


def _dims(fn: str, x: Any, seq_dim: int, head_dim: int) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a tensor, got {describe(x)}")
    out = [normalize_dim(fn, "seq_dim", seq_dim, x), normalize_dim(fn, "head_dim", head_dim, x)]
    if out[0] == out[1]:
        raise ValueError(
            f"{fn}: seq_dim={seq_dim} and head_dim={head_dim} name the same dim of x (shape "
            f"{tuple(x.shape)}); they must differ"
        )
    return out[0], out[1]


def _packed(fn: str, x: torch.Tensor, head_dim: int, num_packed: Any) -> int:
    k = check_int(fn, "num_packed", num_packed, minimum=1)
    if x.shape[head_dim] % k:
        raise ValueError(
            f"{fn}: x.shape[{head_dim}] == {x.shape[head_dim]} (head_dim={head_dim}, shape "
            f"{tuple(x.shape)}) does not pack num_packed={k} equal groups of heads; the head "
            f"dim must be num_packed * heads"
        )
    return k


def _seq_len(fn: str, seq_len: Any) -> int | None:
    if seq_len is None:
        return None
    return check_int(fn, "seq_len", seq_len, minimum=0)


def _split_groups(x: torch.Tensor, seq_dim: int, head_dim: int, k: int) -> tuple:
    """``x`` with its head dim split into (groups, heads); the dims of heads and sequence."""
    if k == 1:
        return x, head_dim, seq_dim
    return x.unflatten(head_dim, (k, -1)), head_dim + 1, seq_dim + (seq_dim > head_dim)


def seq_to_heads(
    x: torch.Tensor,
    axis: Axis,
    *,
    seq_dim: int,
    head_dim: int,
    num_packed: int = 1,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Gather the sequence and scatter the heads over ``axis`` (Ulysses' first all-to-all).

    Rank ``r`` passes its ``L`` tokens along ``seq_dim`` with all ``H`` heads along
    ``head_dim``; it gets all ``N * L`` tokens (every rank's, in rank order) with heads
    ``[r * H / N, (r + 1) * H / N)``. In pseudo-code, with ``x_s`` rank ``s``'s input::

        seq_to_heads(x_r) == cat([x_s for s in ranks], seq_dim)[..., heads of r, ...]

    Args:
        x: this rank's sequence shard.
        axis: the sequence-parallel mesh axis (a name, tuple of names or ``ProcessGroup``).
        seq_dim: the sequence dim of ``x``.
        head_dim: the head dim of ``x``; its size (per packed group) must divide by the axis
            size.
        num_packed: how many groups of heads the head dim packs (3 for fused QKV:
            ``[q | k | v]``); each rank gets heads ``[r * H / N, (r + 1) * H / N)`` of every
            group, packed in the same group order, from a single all-to-all.
        seq_len: the true length of the whole sequence, when it was padded at its end to
            ``N * L``: the result is trimmed to it (padding removed after the exchange).

    Returns:
        The head-sharded tensor. Its transpose is :func:`heads_to_seq` with the same arguments.

    Raises:
        ValueError: the heads do not divide by the axis size (or ``num_packed``), bad dims, or
            ``seq_len`` longer than the gathered sequence.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> qkv = torch.randn(2, 5, 3 * 4, 8)             # (batch, seq, [q|k|v] heads, dim)
        >>> ps.seq_to_heads(qkv, "sp", seq_dim=1, head_dim=2, num_packed=3).shape
        torch.Size([2, 5, 12, 8])
    """
    fn = "seq_to_heads"
    seq_dim, head_dim = _dims(fn, x, seq_dim, head_dim)
    k = _packed(fn, x, head_dim, num_packed)
    s = _seq_len(fn, seq_len)
    info = resolve_axis(axis, fn=fn)
    heads = x.shape[head_dim] // k
    if heads % info.size:
        what = f"{heads} heads" if k == 1 else f"{heads} heads per packed group ({k} groups)"
        raise ValueError(
            f"{fn}: x has {what} along head_dim={head_dim} (shape {tuple(x.shape)}), which do "
            f"not divide by the size {info.size} of axis {info.name!r}; Ulysses gives every rank "
            f"heads / {info.size} heads: use a head count divisible by {info.size} (or a "
            f"smaller axis)"
        )
    y, h, sd = _split_groups(x, seq_dim, head_dim, k)
    y = all_to_all(y, axis, split_dim=h, concat_dim=sd)
    if k > 1:
        y = y.flatten(head_dim, head_dim + 1)
    if s is not None and s != y.shape[seq_dim]:
        if s > y.shape[seq_dim]:
            raise ValueError(
                f"{fn}: seq_len={s} but the gathered sequence has only {y.shape[seq_dim]} tokens "
                f"({info.size} ranks x {x.shape[seq_dim]}); seq_len is the true length before "
                f"padding"
            )
        y = y.narrow(seq_dim, 0, s)
    return y


def heads_to_seq(
    x: torch.Tensor,
    axis: Axis,
    *,
    seq_dim: int,
    head_dim: int,
    num_packed: int = 1,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Gather the heads and scatter the sequence over ``axis`` (Ulysses' second all-to-all),
    the exact inverse of :func:`seq_to_heads`.

    Rank ``r`` passes the whole sequence (``N * L`` tokens, or ``seq_len`` when given) with its
    heads ``[r * H / N, (r + 1) * H / N)``; it gets its ``L`` tokens with all ``H`` heads (every
    rank's heads in rank order, per packed group when ``num_packed > 1``).

    Args:
        x: this rank's head shard of the whole sequence.
        axis: the sequence-parallel mesh axis.
        seq_dim: the sequence dim of ``x``; its size must divide by the axis size unless
            ``seq_len`` is given.
        head_dim: the head dim of ``x``.
        num_packed: how many groups of heads the head dim packs (see :func:`seq_to_heads`).
        seq_len: the true sequence length (``x.shape[seq_dim]``): the sequence is padded with
            zeros at its end to a multiple of the axis size before the exchange, as
            :func:`seq_to_heads` with ``seq_len`` trimmed it.

    Returns:
        The sequence-sharded tensor. Its transpose is :func:`seq_to_heads`.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> x = torch.randn(2, 5, 4, 8)
        >>> y = ps.seq_to_heads(x, "sp", seq_dim=1, head_dim=2)
        >>> torch.equal(ps.heads_to_seq(y, "sp", seq_dim=1, head_dim=2), x)
        True
    """
    fn = "heads_to_seq"
    seq_dim, head_dim = _dims(fn, x, seq_dim, head_dim)
    k = _packed(fn, x, head_dim, num_packed)
    s = _seq_len(fn, seq_len)
    info = resolve_axis(axis, fn=fn)
    length = x.shape[seq_dim]
    if s is not None:
        if s != length:
            raise ValueError(
                f"{fn}: seq_len={s} but x has {length} tokens along seq_dim={seq_dim} (shape "
                f"{tuple(x.shape)}); pass the unpadded sequence with its true length"
            )
        pad = -length % info.size
        if pad:
            x = F.pad(x, [0, 0] * (x.dim() - 1 - seq_dim) + [0, pad])
    elif length % info.size:
        raise ValueError(
            f"{fn}: x has {length} tokens along seq_dim={seq_dim} (shape {tuple(x.shape)}), "
            f"which do not divide by the size {info.size} of axis {info.name!r}; pass "
            f"seq_len={length} to pad the sequence at its end (as seq_to_heads(..., seq_len=) "
            f"trims it)"
        )
    y, h, sd = _split_groups(x, seq_dim, head_dim, k)
    y = all_to_all(y, axis, split_dim=sd, concat_dim=h)
    return y.flatten(head_dim, head_dim + 1) if k > 1 else y

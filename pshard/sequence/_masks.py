"""Attention masks by global position: causal, sliding windows and segment ids.

Pure logic (no process group), shared by Ulysses and ring attention so that both apply exactly
one rule. A query at global position ``i`` with segment id ``a`` sees a key at position ``j``
with segment id ``b`` when all of these hold:

- both are real tokens (``i, j < length``; the padding added by ``shard_map_seq`` is never seen
  and sees nothing);
- ``j <= i`` with ``causal``;
- ``i - left <= j <= i + right`` with ``window=(left, right)`` (``None`` for an unbounded side);
  an int window ``w`` is Hugging Face's ``sliding_window``: ``i - w < j``, i.e. ``(w - 1,
  None)``, which with ``causal`` gives each query its last ``w`` keys, itself included;
- ``a == b`` and ``a >= 0`` with ``segment_ids`` (a negative id sees, and is seen by, nothing).

A query that sees no key at all outputs 0 and gets 0 gradient.

Internal interface:

- ``Window``: ``(left, right)``, each an int ``>= 0`` or ``None``.
- ``check_window(fn, window)``: the normalised window (``None`` when it masks nothing).
- ``check_segment_ids(fn, segment_ids, q, seq_dim, head_dim)``: the ids as int64 with the
  sequence last (``(batch..., seq)``), checked against ``q``.
- ``visible_counts(q_pos, k_pos, length, causal, window)``: exact per-query counts of visible
  keys for sorted position arrays (numpy; what the ring's block schedule is built from).
- ``position_mask(q_pos, k_pos, length, causal, window)``: boolean ``(lq, lk)`` tensor.
- ``segment_mask(q_seg, k_seg)``: boolean ``(batch..., lq, lk)`` tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._core.tree import describe

__all__ = [
    "Window",
    "check_segment_ids",
    "check_window",
    "position_mask",
    "segment_mask",
    "visible_counts",
]

Window = tuple[int | None, int | None]


def _side(fn: str, value: Any, window: Any) -> int | None:
    if value is None or (type(value) is int and value == -1):  # -1: flash-attn's "unbounded"
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{fn}: window={window!r}: each side of a (left, right) window must be an int >= 0, "
            f"or None (or -1) for an unbounded side"
        )
    return value


def check_window(fn: str, window: Any) -> Window | None:
    """``window`` as ``(left, right)`` (``None`` when it masks nothing); see the module docs.

    Example:
        >>> from pshard.sequence._masks import check_window
        >>> check_window("f", 4), check_window("f", (2, 0)), check_window("f", (None, -1))
        ((3, None), (2, 0), None)
    """
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        if window < 1:
            raise ValueError(
                f"{fn}: window={window} must be >= 1 (Hugging Face's sliding_window: query i "
                f"sees key j when i - window < j); use window=(left, right) for other windows"
            )
        return (window - 1, None)
    if isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = (_side(fn, w, window) for w in window)
        return None if left is None and right is None else (left, right)
    raise TypeError(
        f"{fn}: window must be an int (Hugging Face's sliding_window) or a (left, right) pair, "
        f"got {describe(window)}"
    )


def check_segment_ids(
    fn: str, segment_ids: Any, q: torch.Tensor, seq_dim: int, head_dim: int
) -> torch.Tensor:
    """``segment_ids`` as int64 ``(batch..., seq)``: q's shape without its head and feature
    dims, the sequence moved last."""
    want = tuple(n for d, n in enumerate(q.shape[:-1]) if d != head_dim)
    if (
        not isinstance(segment_ids, torch.Tensor)
        or segment_ids.dtype == torch.bool
        or segment_ids.is_floating_point()
        or segment_ids.is_complex()
    ):
        raise TypeError(
            f"{fn}: segment_ids must be an integer tensor of shape {want} (q's shape "
            f"{tuple(q.shape)} without its head and feature dims), got {describe(segment_ids)}"
        )
    if tuple(segment_ids.shape) != want:
        raise ValueError(
            f"{fn}: segment_ids has shape {tuple(segment_ids.shape)} but q has shape "
            f"{tuple(q.shape)} (seq_dim={seq_dim}, head_dim={head_dim}), so segment_ids must be "
            f"{want}: this rank's tokens, one id per token"
        )
    sd = seq_dim if seq_dim < head_dim else seq_dim - 1
    return segment_ids.to(device=q.device, dtype=torch.int64).movedim(sd, -1)


def _bounds(q: np.ndarray, causal: bool, window: Window | None) -> tuple[np.ndarray, np.ndarray]:
    """The inclusive key-position range ``[lo, hi]`` each query may see."""
    lo = np.full(q.shape, np.iinfo(np.int64).min // 2, dtype=np.int64)
    hi = np.full(q.shape, np.iinfo(np.int64).max // 2, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, q)
    if window is not None:
        left, right = window
        if left is not None:
            lo = np.maximum(lo, q - left)
        if right is not None:
            hi = np.minimum(hi, q + right)
    return lo, hi


def visible_counts(
    q_pos: Any, k_pos: Any, length: int, causal: bool, window: Window | None
) -> np.ndarray:
    """For each query position (ascending ``q_pos``), the number of keys of the ascending
    ``k_pos`` it sees by position (segments aside). Exact, in ``O(lq log lk)``.

    Example:
        >>> from pshard.sequence._masks import visible_counts
        >>> visible_counts((0, 4, 8), (1, 5, 9), 10, causal=True, window=None).tolist()
        [0, 1, 2]
        >>> visible_counts((0, 4, 8), (1, 5, 9), 10, causal=False, window=(0, 0)).tolist()
        [0, 0, 0]
    """
    q = np.asarray(q_pos, dtype=np.int64)
    k = np.asarray(k_pos, dtype=np.int64)
    k = k[k < length]
    lo, hi = _bounds(q, causal, window)
    counts = np.searchsorted(k, hi, side="right") - np.searchsorted(k, lo, side="left")
    return np.where((q < length) & (hi >= lo), np.maximum(counts, 0), 0)


def position_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, length: int, causal: bool, window: Window | None
) -> torch.Tensor:
    """Boolean ``(lq, lk)``: which keys each query sees by position (padding, causal, window)."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    ok = (qp < length) & (kp < length)
    if causal:
        ok = ok & (kp <= qp)
    if window is not None:
        left, right = window
        if left is not None:
            ok = ok & (kp >= qp - left)
        if right is not None:
            ok = ok & (kp <= qp + right)
    return ok


def segment_mask(q_seg: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """Boolean ``(batch..., lq, lk)``: same segment, and not a negative (masked) id."""
    qs = q_seg.unsqueeze(-1)
    return (qs == k_seg.unsqueeze(-2)) & (qs >= 0)

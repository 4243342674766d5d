"""Cutting a flex-attention ``BlockMask`` along its batch dim, for :func:`pshard.split`.

A ``BlockMask`` is a leaf of pshard's pytrees: its block tensors are cut along the batch dim as
views, and its ``mask_mod`` (a function of the batch index) is re-indexed by each chunk's batch
offset, so chunk ``c`` sees the batch indices of the whole batch. A batch-1 ``BlockMask``
(broadcast over the batch) keeps its blocks in every chunk, with ``mask_mod`` re-indexed alike.

Internal interface (used by :mod:`pshard._microbatch.split`):

- ``split_block_mask(mask, sizes) -> list``: one ``BlockMask`` per chunk of ``sizes``.
- ``share_block_mask(mask, sizes) -> list``: a batch-1 ``BlockMask`` for every chunk.
- ``offset_mask_mod(mask_mod, offset)``: ``mask_mod`` seen from a chunk starting at ``offset``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["offset_mask_mod", "share_block_mask", "split_block_mask"]

MaskMod = Callable[[Any, Any, Any, Any], Any]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


def offset_mask_mod(mask_mod: MaskMod, offset: int) -> MaskMod:
    """``mask_mod`` seen from a chunk that starts at batch index ``offset``."""
    if offset == 0:
        return mask_mod
    inner = getattr(mask_mod, "_pshard_batch_offset", None)
    if inner is not None:  # a chunk of a chunk: one offset on the original mask_mod
        mask_mod, offset = inner[0], inner[1] + offset

    def mask_mod_at_offset(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b + offset, h, q_idx, kv_idx)

    mask_mod_at_offset._pshard_batch_offset = (mask_mod, offset)  # type: ignore[attr-defined]
    return mask_mod_at_offset


_BLOCK_TENSORS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def split_block_mask(mask: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a ``BlockMask`` along its batch dim into chunks of ``sizes`` (block tensors as
    views, ``mask_mod`` re-indexed by each chunk's batch offset)."""
    offsets = _offsets(sizes)
    if any(getattr(mask, n, None) is not None for n in ("dq_write_order", "dq_kv_order")):
        # torch's own slicing knows how to cut its precomputed dq metadata
        out = []
        for start, n in zip(offsets, sizes, strict=True):
            chunk = mask[start : start + n]
            chunk.mask_mod = offset_mask_mod(mask.mask_mod, start)
            out.append(chunk)
        return out
    pieces = {
        name: (None,) * len(sizes) if t is None else t.split_with_sizes(list(sizes), 0)
        for name in _BLOCK_TENSORS
        for t in (getattr(mask, name),)
    }
    cls = type(mask)
    return [
        cls(
            seq_lengths=mask.seq_lengths,
            **{name: pieces[name][c] for name in _BLOCK_TENSORS},
            BLOCK_SIZE=mask.BLOCK_SIZE,
            mask_mod=offset_mask_mod(mask.mask_mod, start),
        )
        for c, start in enumerate(offsets)
    ]


def share_block_mask(mask: Any, sizes: Sequence[int]) -> list[Any]:
    """A batch-1 ``BlockMask`` for every chunk: the same blocks, ``mask_mod`` re-indexed."""
    out = []
    for start in _offsets(sizes):
        if start == 0:
            out.append(mask)
            continue
        chunk = copy.copy(mask)
        chunk.mask_mod = offset_mask_mod(mask.mask_mod, start)
        out.append(chunk)
    return out

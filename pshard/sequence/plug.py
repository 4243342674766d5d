"""The attention ``sequence_parallel(model, attention=...)`` plugs into a model: what a model
adapter's attention layers call (:class:`pshard._modules.adapter.ModelAdapter.plug`).

- ``ATTENTIONS``: what ``attention=`` takes.
- ``plugged_attention(local_length)``: the attention plugged for the call running now (in its
  forward, or recomputed in its backward), ``None`` outside one.
- ``run_attention(plugged, q, k, v, ...)``: run it on this rank's tokens with the call's
  segment ids.
"""

from __future__ import annotations

from typing import Any

import torch

from ._context import SeqAttention, find_context
from ._ring import ring_attention
from ._ulysses import ulysses_attention
from ._usp import usp_attention

__all__ = ["ATTENTIONS", "plugged_attention", "run_attention"]

#: What ``sequence_parallel(model, attention=...)`` takes.
ATTENTIONS = ("ulysses", "ring", "usp")


def plugged_attention(local_length: int) -> SeqAttention | None:
    """The attention plugged for the ``sequence_parallel`` call running now (in the forward
    pass, or recomputed in its backward pass), for an attention layer given ``local_length``
    tokens; ``None`` outside such a call (the layer runs the model's own attention)."""
    ctx = find_context(None, local_length)
    return None if ctx is None or ctx.call is None else ctx.call.attention


def run_attention(
    plugged: SeqAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    window: int | tuple[int | None, int | None] | None,
    scale: float | None,
    seq_dim: int,
    head_dim: int,
) -> torch.Tensor:
    """Run ``plugged`` (:func:`pshard.ulysses_attention`, :func:`pshard.ring_attention` or
    :func:`pshard.usp_attention`) on this rank's tokens, with the call's segment ids; the
    arguments are those of the attention functions."""
    options: dict[str, Any] = {
        "causal": causal,
        "segment_ids": plugged.segment_ids,
        "window": window,
        "seq_dim": seq_dim,
        "head_dim": head_dim,
        "scale": scale,
    }
    if plugged.kind == "usp":
        ring, ulysses = plugged.axis  # (ring_axis, ulysses_axis)
        return usp_attention(query, key, value, ulysses_axis=ulysses, ring_axis=ring, **options)
    attend = ulysses_attention if plugged.kind == "ulysses" else ring_attention
    return attend(query, key, value, axis=plugged.axis, **options)

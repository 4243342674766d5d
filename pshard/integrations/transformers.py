"""Hugging Face transformers models under :func:`pshard.sequence_parallel`.

``transformers`` stays optional: nothing here imports it until a Hugging Face model is used.

**Attention.** ``sequence_parallel(model, attention="ulysses" | "ring" | "usp")`` sets the model's
``config._attn_implementation`` to ``"pshard|<its own>"`` for the ``with`` block (and back on
exit). That name is registered once with transformers' ``AttentionInterface``; its function
reads the sequence context of the call, runs :func:`pshard.ulysses_attention` or
:func:`pshard.ring_attention` on the ``(batch, heads, seq, head_size)`` tensors the model hands
it (the layer's ``scaling``, its ``sliding_window`` if any, causal when the layer is), with the
call's segment ids, and falls back to the model's own implementation (the part after ``|``)
outside a sequence context. Because no mask function is registered under that name,
transformers builds no ``(seq, seq)`` mask for the local shard: padding and packed documents
reach the attention as segment ids computed over the whole sequence by the pre-hook.

**Activation checkpointing** (``gradient_checkpointing_enable()``): checkpointed layers run
again during the backward pass, which may come after the block has restored the model's own
attention. A backward pass through a call made inside the block therefore plugs pshard's
attention again for the duration of that pass (through the call's ``backward_scope``, see
:mod:`pshard.sequence._context`) and restores the model's own when the pass ends.

**Conventions the hooks own** (see :func:`prepare_call`): a KV cache, ``use_cache=True`` and
``output_attentions`` are refused; ``labels`` are shifted over the whole sequence into
``shift_labels`` before the split (unless given), and ``num_items_in_batch`` is the count of the
whole batch (unless given), so the loss each rank's model computes is its share of the
single-process loss; the post-hook sums the shares (``loss`` is then the single-process loss on
every rank, with a backward that leaves each rank its share of the gradients).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..sequence._context import find_context
from ..sequence._lm import _segments
from ..sequence._ring import ring_attention
from ..sequence._ulysses import ulysses_attention
from ..sequence._usp import usp_attention

__all__ = ["attention_name", "is_hf_model", "plug", "prepare_call", "replug"]

_PREFIX = "pshard|"
_ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` looks like a transformers model (a config with an attention
    implementation)."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "_attn_implementation")


def _own(name: str | None) -> str:
    return name[len(_PREFIX) :] if name and name.startswith(_PREFIX) else (name or "eager")


def attention_name(model: Any) -> str:
    """The model's attention implementation now."""
    return model.config._attn_implementation


def _hf_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """What transformers calls for ``"pshard|<own>"``: q, k, v are ``(batch, heads, seq,
    head_size)``; returns ``(batch, seq, heads, head_size)`` and no attention weights."""
    ctx = find_context(None, query.shape[2])
    call = None if ctx is None else ctx.call
    if call is None or getattr(call, "attention", None) is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        own = _own(module.config._attn_implementation)
        if own == "eager":  # not in the interface: the model file's own eager attention
            fallback = getattr(
                sys.modules.get(type(module).__module__), "eager_attention_forward", None
            )
            if fallback is None:
                raise RuntimeError(
                    f"sequence_parallel: {type(module).__name__} ran outside a sequence-parallel "
                    f"call while its model's attention is plugged, and its eager attention "
                    f"cannot be found; call the model itself inside the block, or outside it"
                )
        else:
            fallback = ALL_ATTENTION_FUNCTIONS[own]
        return fallback(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, sliding_window=sliding_window, **kwargs)  # fmt: skip
    if dropout:
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} asks for attention dropout "
            f"(p={dropout}) in training mode; dropout inside sequence-parallel attention cannot "
            f"match one process (every rank would draw its own mask): set the config's "
            f"attention_dropout to 0, or call model.eval()"
        )
    options = {
        "causal": bool(getattr(module, "is_causal", True)),
        "segment_ids": call.segments,
        "window": sliding_window,
        "seq_dim": 2,
        "head_dim": 1,
        "scale": scaling,
    }
    if call.attention == "usp":  # axis = (ring_axis, ulysses_axis)
        ring, ulysses = call.axis
        out = usp_attention(query, key, value, ulysses_axis=ulysses, ring_axis=ring, **options)
    else:
        out = _ATTENTION[call.attention](query, key, value, axis=call.axis, **options)
    return out.transpose(1, 2), None


def _register(name: str) -> None:
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _hf_attention)


def plug(model: Any, attention: str) -> Callable[[], None]:
    """Make ``model`` use pshard's attention; returns the function that restores its own."""
    own = attention_name(model)
    if own and own.startswith(_PREFIX):
        raise RuntimeError(
            f"sequence_parallel({type(model).__name__}): the model's attention is already "
            f"pshard's ({own!r}): sequence_parallel cannot be nested on one model"
        )
    name = _PREFIX + (own or "eager")
    _register(name)
    model.config._attn_implementation = name

    def restore() -> None:
        model.config._attn_implementation = own

    return restore


def replug(model: Any, name: str) -> Callable[[], None] | None:
    """For a backward pass through a call made inside the block: recomputed (checkpointed)
    layers must run the attention the forward ran, even after the block restored the model's
    own. Plugs ``name`` for the pass if the model is not using it; returns the undo."""
    own = attention_name(model)
    if own == name:
        return None
    model.config._attn_implementation = name

    def undo() -> None:
        model.config._attn_implementation = own

    return undo


def _refuse(model: Any, kwargs: dict[str, Any]) -> None:
    name = type(model).__name__
    cache = kwargs.get("past_key_values")
    if cache is not None:
        raise ValueError(
            f"sequence_parallel({name}): a KV cache (past_key_values) cannot be used inside the "
            f"block: each rank holds only its tokens' keys and values, so the cache would be "
            f"wrong for the next step; generate outside the block (without sequence_parallel)"
        )
    if kwargs.get("use_cache"):
        raise ValueError(
            f"sequence_parallel({name}): use_cache=True (a KV cache, as generate() asks for) "
            f"cannot be used inside the block: each rank holds only its tokens' keys and values; "
            f"pass use_cache=False, or generate outside the block"
        )
    config = getattr(model, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError(
            f"sequence_parallel({name}): output_attentions=True cannot be honoured: "
            f"sequence-parallel attention never forms the (seq, seq) attention weights (no rank "
            f"holds them); turn output_attentions off"
        )


def prepare_call(
    model: Any, kwargs: dict[str, Any], accepts: Callable[[str], bool], length: int
) -> tuple[dict[str, Any], torch.Tensor | None, bool]:
    """The whole-sequence side of a call: refusals, ``use_cache=False``, labels shifted over
    the whole sequence, the whole batch's ``num_items_in_batch``, and the segment ids of padding
    and packed rows. Returns ``(kwargs, segment ids or None, whether the model's loss is a
    per-rank share to sum)``."""
    _refuse(model, kwargs)
    kwargs = dict(kwargs)
    if accepts("use_cache"):
        kwargs["use_cache"] = False
    mask = kwargs.get("attention_mask")
    positions = kwargs.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ValueError(
            f"sequence_parallel({type(model).__name__}): attention_mask must be a (batch, seq) "
            f"tensor of 1 (token) and 0 (padding); a 4-D or custom mask cannot be split by "
            f"position: pass padding as attention_mask and packed documents as position_ids"
        )
    segments = _segments(
        positions if isinstance(positions, torch.Tensor) and positions.dim() == 2 else None,
        mask,
    )
    labels = kwargs.get("labels")
    share = False
    if isinstance(labels, torch.Tensor):
        if labels.dim() != 2 or labels.shape[1] != length:
            raise ValueError(
                f"sequence_parallel({type(model).__name__}): labels must be (batch, seq) with "
                f"seq = {length}, got shape {tuple(labels.shape)}"
            )
        if kwargs.get("shift_labels") is None:
            kwargs["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=-100)
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (kwargs["shift_labels"] != -100).sum()
        share = True
    return kwargs, segments, share

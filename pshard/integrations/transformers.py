"""Hugging Face transformers models under :func:`pshard.sequence_parallel`: the model adapter
(:class:`pshard._modules.adapter.ModelAdapter`) of models whose config has an
``_attn_implementation``, registered when this module is imported (``import pshard`` does).

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
attention again for the duration of that pass (:meth:`TransformersAdapter.use_attention`,
through the call's backward scope, see :mod:`pshard.sequence._context`) and restores the model's
own when the pass ends.

**Conventions the adapter owns** (:meth:`TransformersAdapter.prepare`, applied by the hooks to
the whole call before the split): a KV cache, ``use_cache=True`` and
``output_attentions`` are refused; ``labels`` are shifted over the whole sequence into
``shift_labels`` before the split (unless given), and ``num_items_in_batch`` is the count of the
whole batch (unless given), so the loss each rank's model computes is its share of the
single-process loss; the post-hook sums the shares (:meth:`TransformersAdapter.sum_loss`:
``loss`` is then the single-process loss on every rank, with a backward that leaves each rank
its share of the gradients).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._modules.adapter import PreparedCall, Reduce, register_adapter
from ..sequence._lm import (
    ATTENTION_MASK,
    IGNORE_INDEX,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    POSITION_IDS,
    SHIFT_LABELS,
    segment_ids_of,
    shift_labels,
)
from ..sequence.plug import plugged_attention, run_attention

__all__ = ["TransformersAdapter"]

_PREFIX = "pshard|"


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _own(name: str | None) -> str:
    return name[len(_PREFIX) :] if name and name.startswith(_PREFIX) else (name or "eager")


def _hf_attention(
    module: nn.Module,
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
    plugged = plugged_attention(query.shape[2])
    if plugged is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        own = _own(_config(module)._attn_implementation)
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
    out = run_attention(
        plugged, query, key, value, causal=bool(getattr(module, "is_causal", True)),
        window=sliding_window, scale=scaling, seq_dim=2, head_dim=1,
    )  # fmt: skip
    return out.transpose(1, 2), None


def _register(name: str) -> None:
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _hf_attention)


def _set_attention(model: nn.Module, name: str) -> Callable[[], None]:
    """Set the model's attention implementation to ``name``; returns the undo."""
    config = _config(model)
    own = config._attn_implementation
    config._attn_implementation = name

    def undo() -> None:
        config._attn_implementation = own

    return undo


def _refuse(model: nn.Module, kwargs: dict[str, Any]) -> None:
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
    config = _config(model)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError(
            f"sequence_parallel({name}): output_attentions=True cannot be honoured: "
            f"sequence-parallel attention never forms the (seq, seq) attention weights (no rank "
            f"holds them); turn output_attentions off"
        )


class TransformersAdapter:
    """The :class:`~pshard._modules.adapter.ModelAdapter` of Hugging Face transformers models
    (see the module docs)."""

    name = "transformers"
    interface = "a Hugging Face model's attention interface (a config._attn_implementation)"

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` looks like a transformers model (a config with an attention
        implementation)."""
        config = _config(model)
        return config is not None and hasattr(config, "_attn_implementation")

    def attention_name(self, model: nn.Module) -> str:
        """The model's attention implementation now."""
        return str(_config(model)._attn_implementation)

    def plug(self, model: nn.Module) -> Callable[[], None]:
        """Make ``model`` use pshard's attention; returns the function that restores its own."""
        own = _config(model)._attn_implementation
        if own and own.startswith(_PREFIX):
            raise RuntimeError(
                f"sequence_parallel({type(model).__name__}): the model's attention is already "
                f"pshard's ({own!r}): sequence_parallel cannot be nested on one model"
            )
        name = _PREFIX + (own or "eager")
        _register(name)
        return _set_attention(model, name)

    def use_attention(self, model: nn.Module, name: str) -> Callable[[], None] | None:
        """For a backward pass through a call made inside the block: recomputed (checkpointed)
        layers must run the attention the forward ran, even after the block restored the
        model's own. Plugs ``name`` for the pass if the model is not using it; returns the
        undo."""
        if self.attention_name(model) == name:
            return None
        return _set_attention(model, name)

    def prepare(
        self,
        model: nn.Module,
        kwargs: dict[str, Any],
        accepts: Callable[[str], bool],
        length: int,
    ) -> PreparedCall:
        """The whole-sequence side of a call: refusals, ``use_cache=False``, labels shifted
        over the whole sequence, the whole batch's ``num_items_in_batch``, and the segment ids
        of padding and packed rows; the model's loss is then each rank's share."""
        _refuse(model, kwargs)
        kwargs = dict(kwargs)
        if accepts("use_cache"):
            kwargs["use_cache"] = False
        mask = kwargs.get(ATTENTION_MASK)
        positions = kwargs.get(POSITION_IDS)
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                f"sequence_parallel({type(model).__name__}): {ATTENTION_MASK} must be a (batch, "
                f"seq) tensor of 1 (token) and 0 (padding); a 4-D or custom mask cannot be split "
                f"by position: pass padding as {ATTENTION_MASK} and packed documents as "
                f"{POSITION_IDS}"
            )
        segments = segment_ids_of(
            positions if isinstance(positions, torch.Tensor) and positions.dim() == 2 else None,
            mask,
        )
        labels = kwargs.get(LABELS)
        share = False
        if isinstance(labels, torch.Tensor):
            if labels.dim() != 2 or labels.shape[1] != length:
                raise ValueError(
                    f"sequence_parallel({type(model).__name__}): {LABELS} must be (batch, seq) "
                    f"with seq = {length}, got shape {tuple(labels.shape)}"
                )
            if kwargs.get(SHIFT_LABELS) is None:
                kwargs[SHIFT_LABELS] = shift_labels(labels, IGNORE_INDEX)
            if kwargs.get(NUM_ITEMS_IN_BATCH) is None:
                kwargs[NUM_ITEMS_IN_BATCH] = (kwargs[SHIFT_LABELS] != IGNORE_INDEX).sum()
            share = True
        return PreparedCall(kwargs, segments, share)

    def sum_loss(self, output: Any, reduce: Reduce) -> Any:
        """The loss of a ``ModelOutput`` (``output.loss``, also ``output[0]`` of a tuple)
        summed over the ranks."""
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (reduce(output[0], "output[0]"), *output[1:])
        try:
            loss = output["loss"]
        except (KeyError, TypeError, IndexError):
            return output
        if loss is not None:
            output["loss"] = reduce(loss, "output['loss']")
        return output


register_adapter(TransformersAdapter())

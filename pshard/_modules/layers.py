"""``ps.checkpoint_layers``: a model's own layer-by-layer checkpointing run by ``ps.checkpoint``
with a policy, through its family's adapter (:class:`pshard._modules.adapter.LayersPart`)."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from torch import nn

from .._core.tree import describe
from .._remat.checkpoint import checkpoint
from .._remat.policies import resolve
from .adapter import layers_part

__all__ = ["checkpoint_layers"]

M = TypeVar("M", bound=nn.Module)


def checkpoint_layers(model: M, policy: Any = None) -> M:
    """Checkpoint each layer of ``model`` with :func:`pshard.checkpoint` and ``policy``, where
    the model's own gradient checkpointing would (a Hugging Face model's decoder layers: what
    ``gradient_checkpointing_enable()`` wraps in ``torch.utils.checkpoint``, which cannot run
    under ``torch.func``).

    The layers are checkpointed while the model is in training mode (``model.train()``), as the
    model's own checkpointing is; the derivatives are those of the model without checkpoints
    under every ``torch.func`` transform and ``.backward()``, and values the layers record by
    forward hooks (router logits, hidden states) keep their gradients.

    Args:
        model: a model whose family a registered adapter knows (Hugging Face models).
        policy: what each layer keeps for the backward (one of
            :data:`pshard.checkpoint_policies`, a callable policy, or ``None``:
            ``nothing_saveable``).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a module, or no registered family knows its layers
            (checkpoint them yourself: ``layer = ps.checkpoint(layer, policy=...)``); a policy
            that is not one.

    Example:
        >>> import torch, pshard as ps
        >>> ps.checkpoint_layers(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: checkpoint_layers: no registered model family knows the layers of Linear; ...
    """
    fn = "checkpoint_layers"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {describe(model)}")
    checkpointed = functools.partial(checkpoint, policy=resolve(policy, fn=f"ps.{fn}"))
    part = layers_part(model)
    if part is None or not part.checkpoint_layers(model, checkpointed):
        raise TypeError(
            f"{fn}: no registered model family knows the layers of {type(model).__name__}; "
            f"checkpoint them yourself (model.layers[i] = ps.checkpoint(layer, policy=...), or "
            f"ps.checkpoint(fn, policy=...) around the code that runs a layer)"
        )
    return model

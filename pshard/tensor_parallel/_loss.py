"""``ps.cross_entropy``: cross-entropy on logits whose vocabulary is split over a mesh axis.

Each rank holds the logits of a contiguous range of the vocabulary (the head's output under
tensor parallelism with ``loss_parallel``: ``torch.chunk``'s split, uneven ones included). The
loss of a token is ``logsumexp(logits) - logits[target]`` over the whole vocabulary, computed
without gathering it: the running max and the sum of exponentials are reduced over the axis
(one ``pmax``, one ``psum``), and the target's logit comes from the rank whose range holds the
target (the others add 0). Gradients flow through the collectives (their transposes), so the
function works under every ``torch.func`` transform and ``.backward()`` like the rest of pshard.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .._collectives.functions import all_gather, axis_index, pmax, psum
from .._compat import is_wrapped
from .._core.tree import describe
from .._runtime.mesh import Axis

__all__ = ["cross_entropy"]

_FN = "cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_LOW = (torch.float16, torch.bfloat16)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    axis: Axis | None = None,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., vocab)``) against integer ``labels``
    (``logits.shape[:-1]``), exact when the vocabulary is split over ``axis``.

    In pseudo-code, with ``whole`` the logits of the whole vocabulary (never formed)::

        loss[i] = logsumexp(whole[i]) - whole[i, labels[i]]      # 0 where labels[i] == ignore_index
        mean: loss.sum() / (labels != ignore_index).sum();  sum: loss.sum();  none: loss

    With ``axis=None`` it is ``torch.nn.functional.cross_entropy`` over the last dim. With an
    axis, each rank passes its block of the logits: a contiguous range of the vocabulary, the
    ranks' ranges in rank order (``torch.chunk``'s split of the head's output under
    ``ps.tensor_parallel(..., loss_parallel=True)``; any sizes, read from the blocks), and the
    same ``labels`` (global vocabulary ids). Every rank gets the whole loss. Call it where the
    blocks are: inside a map over ``axis``; the gradient with respect to each rank's block is
    its block of the whole gradient (``softmax - one_hot``), under ``torch.func.grad`` of the
    map and ``.backward()``. Half-precision logits are reduced in float32 and the loss is
    returned in their dtype.

    Args:
        logits: ``(..., vocab)`` floating logits (this rank's vocabulary block with ``axis``).
        labels: integer targets of shape ``logits.shape[:-1]``.
        axis: the mesh axis (name, tuple of names or ``ProcessGroup``) the vocabulary is split
            over; ``None``: not split.
        ignore_index: labels equal to it add nothing and are not counted by ``"mean"``.
        reduction: ``"mean"`` (over the targets not ignored; NaN when there are none, as
            torch), ``"sum"`` or ``"none"``.

    Returns:
        The loss: a scalar, or the per-token losses (``labels.shape``) for ``"none"``.

    Raises:
        TypeError: ``logits`` is not a floating tensor, ``labels`` not an integer tensor.
        ValueError: ``labels``' shape is not ``logits.shape[:-1]``, an unknown ``reduction``,
            or (outside transforms) a label outside the whole vocabulary.

    Example:
        >>> import torch, pshard as ps
        >>> logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
        >>> labels = torch.tensor([0, -100])
        >>> ps.cross_entropy(logits, labels)
        tensor(0.1698)
        >>> torch.nn.functional.cross_entropy(logits, labels)
        tensor(0.1698)
    """
    _check(logits, labels, reduction)
    if axis is None:
        flat = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        )
        return flat.reshape(labels.shape) if reduction == "none" else flat
    x = logits.float() if logits.dtype in _LOW else logits
    width = x.shape[-1]
    sizes = all_gather(torch.tensor([width], device=x.device), axis, tiled=True).tolist()
    start = sum(sizes[: axis_index(axis)])
    # the max of every token's logits over the whole vocabulary (a constant for the gradient)
    local_max = x.detach().amax(-1) if width else x.new_full(x.shape[:-1], -torch.inf)
    top = pmax(local_max, axis)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sum_exp = (x - top.unsqueeze(-1)).exp().sum(-1)
    index = labels - start
    held = (index >= 0) & (index < width)
    if width:
        picked = x.gather(-1, index.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(held, picked, torch.zeros_like(picked))
    else:
        picked = x.new_zeros(x.shape[:-1])
    sum_exp, target, hits = psum(torch.stack([sum_exp, picked, held.to(x.dtype)]), axis).unbind(0)
    valid = labels != ignore_index
    _check_range(labels, valid, hits, sum(sizes), ignore_index)
    loss = torch.where(valid, top + sum_exp.log() - target, torch.zeros_like(target))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum()
    return loss.to(logits.dtype)


def _check(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{_FN}: logits must be a floating tensor, got {describe(logits)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise TypeError(
            f"{_FN}: labels must be an integer tensor of class ids, got {describe(labels)}"
        )
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{_FN}: labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])} "
            f"(one target per row of logits, the vocabulary last), got {tuple(labels.shape)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{_FN}: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got "
            f"{reduction!r}"
        )


def _check_range(
    labels: torch.Tensor, valid: torch.Tensor, hits: torch.Tensor, vocab: int, ignore: int
) -> None:
    """A label no rank holds is an error (checked where the values can be read)."""
    if is_wrapped(labels) or is_wrapped(hits) or torch.compiler.is_compiling():
        return
    missing = valid & (hits == 0)
    if bool(missing.any()):
        bad = labels[missing].unique()[:5].tolist()
        raise ValueError(
            f"{_FN}: labels {bad} are outside the vocabulary [0, {vocab}) that the ranks' "
            f"logits cover (and not ignore_index={ignore}); check the labels, or that every "
            f"rank passes its block of the vocabulary"
        )

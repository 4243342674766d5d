"""Causal-LM batches and losses for sequence parallelism.

The keys of a causal-LM batch are pshard's own convention (:func:`prepare_lm_batch` writes them,
:func:`pshard.sequence_parallel` reads them; they are the names Hugging Face models take), defined
once here: :data:`INPUT_IDS`, :data:`INPUTS_EMBEDS`, :data:`LABELS`, :data:`SHIFT_LABELS`,
:data:`POSITION_IDS`, :data:`ATTENTION_MASK`, :data:`SEGMENT_IDS`, :data:`LOGITS_TO_KEEP`,
:data:`NUM_ITEMS_IN_BATCH`, and the output :data:`LOGITS`.

Two bugs recur in sequence-parallel training code, and these two functions remove them:

- *Shifting labels after sharding.* A causal LM predicts token ``t + 1`` at position ``t``; if each
  rank shifts its own shard of ``labels``, the target of the last position of every shard (the
  first token of the next shard) is lost, one target per shard boundary.
  :func:`prepare_lm_batch` shifts over the whole sequence *before* any sharding, into
  ``shift_labels`` (the name Hugging Face models read), so each position carries its own target
  wherever it lands.
- *Normalising by local token counts.* Each rank's mean over its own targets, averaged over
  ranks, is not the mean over all targets (and is ``0 / 0`` on a rank without targets).
  :func:`token_mean_loss` divides the global sum by the global count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .._collectives.functions import psum
from .._compat import tracing
from .._core.checks import check_int
from .._core.tree import describe
from .._runtime.mesh import Axis

__all__ = [
    "ATTENTION_MASK",
    "IGNORE_INDEX",
    "INPUTS_EMBEDS",
    "INPUT_IDS",
    "LABELS",
    "LABEL_KEYS",
    "LOGITS",
    "LOGITS_TO_KEEP",
    "NUM_ITEMS_IN_BATCH",
    "POSITION_IDS",
    "SEGMENT_IDS",
    "SEQUENCE_KEYS",
    "SHIFT_LABELS",
    "prepare_lm_batch",
    "segment_ids_of",
    "shift_labels",
    "token_mean_loss",
]

# --------------------------------------------------------------------------- the batch's keys

#: The tokens, ``(batch, seq)``.
INPUT_IDS = "input_ids"
#: The tokens already embedded, ``(batch, seq, hidden)`` (instead of :data:`INPUT_IDS`).
INPUTS_EMBEDS = "inputs_embeds"
#: The keys a call's sequence length is read from, in this order.
SEQUENCE_KEYS = (INPUT_IDS, INPUTS_EMBEDS)
#: The labels of every position, before the shift.
LABELS = "labels"
#: The target of every position (:data:`LABELS` shifted left by one over the whole sequence).
SHIFT_LABELS = "shift_labels"
#: Keys holding labels: padded with :data:`IGNORE_INDEX` when a sequence is split.
LABEL_KEYS = frozenset({LABELS, SHIFT_LABELS})
#: The global position of every token, ``(batch, seq)`` (restarting at 0 for packed documents).
POSITION_IDS = "position_ids"
#: 1 for a token, 0 for padding, ``(batch, seq)``.
ATTENTION_MASK = "attention_mask"
#: The attention functions' segment ids, ``(batch, seq)`` (-1: padding).
SEGMENT_IDS = "segment_ids"
#: Which positions' logits the model computes: an int (the last ``k``) or a boolean mask.
LOGITS_TO_KEEP = "logits_to_keep"
#: The number of targets of the whole batch: the token-mean loss's denominator.
NUM_ITEMS_IN_BATCH = "num_items_in_batch"
#: The model output gathered at the positions :data:`LOGITS_TO_KEEP` keeps.
LOGITS = "logits"
#: The label of a position without a target.
IGNORE_INDEX = -100


def prepare_lm_batch(
    batch: Mapping[str, Any],
    *,
    ignore_index: int = IGNORE_INDEX,
    logits_to_keep: int | torch.Tensor | None = None,
) -> dict[str, Any]:
    """Make a causal-LM batch ready to be split along its sequence (dim 1).

    Call it on the whole batch, before ``shard_map_seq`` / ``sequence_parallel`` split it. It
    returns a new dict (``batch`` is not modified) with:

    - ``"labels"``: as given; when absent, ``input_ids`` with positions where
      ``attention_mask == 0`` set to ``ignore_index`` (the usual causal-LM labels).
    - ``"shift_labels"``: the target of every position, ``labels`` shifted left by one over the
      *whole* sequence, the last position getting ``ignore_index``. The loss at position ``t``
      is ``cross_entropy(logits[:, t], shift_labels[:, t])``, with no further shift. (Hugging
      Face causal-LM losses use ``shift_labels`` as they are when it is passed.) A given
      ``shift_labels`` is kept as it is.
    - ``"position_ids"``: ``arange(seq_len)`` per row, when absent. Given ones are kept, so the
      per-document positions of packed rows survive the split.
    - ``"segment_ids"``: when the batch has padding (``attention_mask`` zeros, left or right)
      or packed documents (``position_ids`` restarting at 0 inside a row, as Hugging Face's
      ``DataCollatorWithFlattening`` makes them), an int64 ``(batch, seq)`` tensor for the
      attention functions' ``segment_ids``: each document of a row gets its own id (a new one
      starts wherever ``position_ids`` is 0) and padding gets -1 (it sees, and is seen by,
      nothing). Absent when there is neither (plain causal attention needs no mask); a given
      one is kept. Packed labels should hold ``ignore_index`` at each document's first token
      (the collator does this), so that no target crosses a document boundary.
    - ``"logits_to_keep"``: an int ``k`` (the argument, else an int in ``batch``) becomes a
      boolean mask over the whole sequence, ``True`` on the last ``k`` positions (``k == 0``
      keeps every position, as in Hugging Face models), so that splitting it gives each rank
      the mask of its own tokens. A tensor is kept as it is.
    - ``"num_items_in_batch"``: the number of targets (``shift_labels != ignore_index``, only
      at kept positions when ``logits_to_keep`` is set), a 0-dim int64 tensor: the denominator
      of the token-mean loss over the whole batch (see :func:`token_mean_loss`).

    Args:
        batch: a Mapping with ``"input_ids"`` (``(batch, seq)``) and/or ``"labels"``; other
            keys are copied.
        ignore_index: the label of positions without a target.
        logits_to_keep: keep the logits of the last ``k`` positions only (or a mask).

    Returns:
        A new dict.

    Raises:
        TypeError: ``batch`` is not a Mapping.
        ValueError: no ``labels`` nor ``input_ids``, or a tensor whose shape does not fit the
            batch (an ``attention_mask``, ``position_ids`` or ``segment_ids`` that is not
            ``(batch, seq)``, a ``logits_to_keep`` mask that is not ``(seq,)``).

    Example:
        >>> import torch, pshard as ps
        >>> batch = ps.prepare_lm_batch({"input_ids": torch.tensor([[5, 6, 7, 8]])},
        ...                             logits_to_keep=2)
        >>> batch["shift_labels"]
        tensor([[   6,    7,    8, -100]])
        >>> batch["position_ids"], batch["logits_to_keep"], batch["num_items_in_batch"]
        (tensor([[0, 1, 2, 3]]), tensor([False, False,  True,  True]), tensor(1))
    """
    fn = "prepare_lm_batch"
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{fn}: batch must be a Mapping (dict, BatchEncoding) of tensors, got {describe(batch)}"
        )
    ignore_index = check_int(fn, "ignore_index", ignore_index)
    out = dict(batch)
    labels = out.get(LABELS)
    ids = out.get(INPUT_IDS)
    if labels is None:
        if not isinstance(ids, torch.Tensor):
            raise ValueError(
                f"{fn}: the batch has neither {LABELS!r} nor an {INPUT_IDS!r} tensor to derive "
                f"them from (keys {list(out)}); add one of them"
            )
        labels = ids
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        raise ValueError(
            f"{fn}: batch[{LABELS!r}] must be a tensor of shape (batch, seq, ...), got "
            f"{describe(labels)}"
        )
    seq_len = labels.shape[1]
    for key in (INPUT_IDS, SHIFT_LABELS):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and (value.dim() < 2 or value.shape[1] != seq_len):
            raise ValueError(
                f"{fn}: batch[{key!r}] has shape {tuple(value.shape)} but batch[{LABELS!r}] has "
                f"{seq_len} tokens along dim 1 (shape {tuple(labels.shape)}); every sequence "
                f"tensor must have the same length"
            )
    rows = (labels.shape[0], seq_len)
    for key in (ATTENTION_MASK, POSITION_IDS, SEGMENT_IDS):
        value = out.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape != rows):
            raise ValueError(
                f"{fn}: batch[{key!r}] must be a (batch, seq) = {rows} tensor like the labels, "
                f"got {describe(value)}"
            )
    mask = out.get(ATTENTION_MASK)
    if LABELS not in out:
        out[LABELS] = labels = (
            labels.clone() if mask is None else labels.masked_fill(mask == 0, ignore_index)
        )
    if out.get(SHIFT_LABELS) is None:
        out[SHIFT_LABELS] = shift_labels(labels, ignore_index)
    shifted = out[SHIFT_LABELS]
    if out.get(SEGMENT_IDS) is None:
        segments = segment_ids_of(out.get(POSITION_IDS), mask)
        if segments is not None:
            out[SEGMENT_IDS] = segments
    if out.get(POSITION_IDS) is None:
        out[POSITION_IDS] = (
            torch.arange(seq_len, dtype=torch.int64, device=labels.device)
            .unsqueeze(0)
            .expand(labels.shape[0], seq_len)
        )
    keep = out.get(LOGITS_TO_KEEP) if logits_to_keep is None else logits_to_keep
    if keep is not None and not isinstance(keep, torch.Tensor):
        k = check_int(fn, "logits_to_keep", keep, minimum=0)
        positions = torch.arange(seq_len, device=labels.device)
        keep = positions >= (seq_len - k if k else 0)
    if keep is not None:
        if keep.dtype != torch.bool or keep.shape != (seq_len,):
            raise ValueError(
                f"{fn}: logits_to_keep must be an int or a boolean mask of shape ({seq_len},) "
                f"over the sequence, got {describe(keep)}"
            )
        out[LOGITS_TO_KEEP] = keep
    targets = shifted != ignore_index
    if keep is not None:
        targets = targets & keep.view(1, seq_len, *([1] * (shifted.dim() - 2)))
    out[NUM_ITEMS_IN_BATCH] = targets.sum()
    return out


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The target of every position: ``labels`` (``(batch, seq, ...)``) shifted left by one
    over the whole sequence, the last position getting ``ignore_index``."""
    seq_len = labels.shape[1]
    if not seq_len:
        return labels.clone()
    pad = [0, 0] * (labels.dim() - 2) + [0, 1]
    return F.pad(labels.narrow(1, 1, seq_len - 1), pad, value=ignore_index)


def segment_ids_of(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Segment ids of packed rows and padding (see :func:`prepare_lm_batch`), or ``None``
    when the batch has neither. While traced (``ps.jit``: the values unknown) a mask or
    positions given always make segment ids (all 0 where there is neither: the same
    attention)."""
    traced = tracing([t for t in (position_ids, attention_mask) if t is not None])
    padded = attention_mask is not None and (traced or bool((attention_mask == 0).any()))
    starts = None
    if position_ids is not None and position_ids.shape[1] > 1:
        starts = position_ids == 0
        if not traced and not bool(starts[:, 1:].any()):
            starts = None
    if not padded and starts is None:
        return None
    if starts is None:  # padding alone
        if attention_mask is None:
            return None
        starts = torch.zeros(attention_mask.shape, dtype=torch.bool, device=attention_mask.device)
    starts = starts.clone()
    starts[:, 0] = True  # the first token starts segment 0
    seg = starts.to(torch.int64).cumsum(1) - 1
    if attention_mask is not None:
        seg = seg.masked_fill(attention_mask == 0, -1)
    return seg


def token_mean_loss(
    losses_sum: torch.Tensor, num_tokens: torch.Tensor | int, axis: Axis
) -> torch.Tensor:
    """The mean loss per token over every rank of ``axis``: ``psum(losses_sum) /
    psum(num_tokens)``.

    Each rank passes the *sum* of its per-token losses and its number of tokens (e.g. its
    targets ``shift_labels != -100``); every rank gets the same global mean. A rank without
    tokens passes zeros; when no rank has a token the result is 0 (never NaN). One all-reduce
    carries both sums, in float32 at least (a ``float16`` loss with more than 65504 tokens keeps
    an exact count); the result has ``losses_sum``'s dtype. Differentiable in ``losses_sum``
    (``psum``'s transpose is ``psum``, so inside ``shard_map_seq`` the gradient is the
    single-process gradient of the token mean); ``num_tokens`` is a count and gets no gradient.

    Args:
        losses_sum: this rank's sum of per-token losses (a floating-point tensor, usually 0-dim).
        num_tokens: this rank's number of tokens (a non-negative int or integer tensor
            broadcastable with ``losses_sum``).
        axis: the mesh axis (or axes) the tokens are split over.

    Returns:
        ``psum(losses_sum, axis) / psum(num_tokens, axis)`` (0 when the count is 0).

    Example:
        >>> import torch, pshard as ps
        >>> import torch.nn.functional as F
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> logits, targets = torch.randn(6, 10), torch.tensor([1, 2, -100, 4, 5, -100])
        >>> total = F.cross_entropy(logits, targets, reduction="sum")
        >>> loss = ps.token_mean_loss(total, (targets != -100).sum(), "sp")
        >>> torch.allclose(loss, F.cross_entropy(logits, targets))
        True
        >>> ps.token_mean_loss(torch.tensor(0.0), 0, "sp")
        tensor(0.)
    """
    fn = "token_mean_loss"
    if not isinstance(losses_sum, torch.Tensor) or not losses_sum.is_floating_point():
        raise TypeError(
            f"{fn}: losses_sum must be a floating-point tensor (the sum of this rank's per-token "
            f"losses), got {describe(losses_sum)}"
        )
    count = torch.as_tensor(num_tokens, device=losses_sum.device).detach()
    if count.is_floating_point() or count.is_complex() or count.dtype == torch.bool:
        raise TypeError(
            f"{fn}: num_tokens must be an integer count (an int or an integer tensor), got "
            f"{describe(num_tokens)}"
        )
    if bool((count < 0).any()):
        raise ValueError(f"{fn}: num_tokens must be >= 0, got {count.tolist()}")
    # counts beyond float16's range (65504) stay exact: reduce in float32 at least
    acc = torch.promote_types(losses_sum.dtype, torch.float32)
    try:
        total, count = torch.broadcast_tensors(losses_sum.to(acc), count.to(acc))
    except RuntimeError:
        raise ValueError(
            f"{fn}: num_tokens (shape {tuple(count.shape)}) does not broadcast with losses_sum "
            f"(shape {tuple(losses_sum.shape)})"
        ) from None
    both = psum(torch.stack([total, count]), axis)
    # no tokens anywhere: the mean is 0 (whatever losses_sum holds), with a zero gradient
    some = both[1] > 0
    mean = both[0] / torch.where(some, both[1], torch.ones_like(both[1]))
    return torch.where(some, mean, torch.zeros_like(mean)).to(losses_sum.dtype)

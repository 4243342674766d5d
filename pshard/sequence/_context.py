"""The sequence context: which layout this rank's tokens are in, while a sequence is split.

``shard_map_seq`` (and the ``sequence_parallel`` hooks) enter a context for the duration of the
mapped function; attention functions and :func:`seq_positions` read it to learn the true global
position of every local token and which tokens are padding. It is a context variable holding a
stack, so nested maps see their own layout and everything is restored on exit (also on
exceptions); there is no process-global state.

Internal interface:

- ``SeqContext(axis, layout, rank, device)``: one entry (``axis`` as a tuple of mesh-axis
  names, or a ``ProcessGroup``); ``positions()`` gives this rank's positions as an int64 tensor.
- ``sequence_context(ctx)``: context manager pushing ``ctx``.
- ``find_context(axis)``: the innermost entry for ``axis`` (``None`` when there is none).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._mesh import Axis
from ._layouts import SeqLayout

__all__ = ["SeqContext", "find_context", "normalize_axis", "seq_positions", "sequence_context"]

_STACK: contextvars.ContextVar[tuple[SeqContext, ...]] = contextvars.ContextVar(
    "pshard_sequence_context", default=()
)


def normalize_axis(axis: Axis) -> tuple[str, ...] | dist.ProcessGroup:
    """``"sp"`` -> ``("sp",)``; tuples of names as tuples; a ``ProcessGroup`` as itself."""
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, (tuple, list)):
        return tuple(axis)
    return axis


@dataclasses.dataclass(frozen=True)
class SeqContext:
    """This rank's part of one split sequence.

    Attributes:
        axis: the axis the sequence is split over (normalised, see :func:`normalize_axis`).
        layout: the layout (true length, padding, permutation).
        rank: this rank's index on the axis.
        device: where position tensors are made.
    """

    axis: Any
    layout: SeqLayout
    rank: int
    device: torch.device

    def positions(self) -> torch.Tensor:
        """This rank's global positions (int64, ``layout.local_length`` of them; values
        ``>= layout.length`` are padding)."""
        return self.layout.position_tensor(self.rank, self.device)


@contextlib.contextmanager
def sequence_context(ctx: SeqContext) -> Iterator[SeqContext]:
    """Push ``ctx`` for the ``with`` block; the previous stack comes back on exit."""
    token = _STACK.set((*_STACK.get(), ctx))
    try:
        yield ctx
    finally:
        _STACK.reset(token)


def find_context(axis: Axis | None = None) -> SeqContext | None:
    """The innermost context for ``axis`` (any axis when ``None``), or ``None``."""
    stack = _STACK.get()
    if not stack:
        return None
    if axis is None:
        return stack[-1]
    key = normalize_axis(axis)
    for ctx in reversed(stack):
        if ctx.axis == key:
            return ctx
    return None


def seq_positions(axis: Axis | None = None) -> torch.Tensor:
    """The global positions of this rank's tokens, inside ``shard_map_seq``.

    Position ``p`` is the index of the token in the whole (unsplit) sequence; positions
    ``>= seq_len`` are the padding added to make the sequence split evenly. Under the
    ``"zigzag"`` and ``"stripe"`` layouts they are not contiguous, which is why rotary
    embeddings and masks should be computed from them rather than from ``arange``.

    Args:
        axis: the sequence axis to ask about; default the innermost ``shard_map_seq``.

    Returns:
        A 1-D int64 tensor, one position per local token (on the device of the sharded
        inputs).

    Raises:
        RuntimeError: outside ``shard_map_seq`` (or the ``sequence_parallel`` hooks).

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> @ps.shard_map_seq(in_specs=ps.Shard(1), out_specs=ps.Shard(1), layout="zigzag")
        ... def where(x):
        ...     return x + 100 * ps.seq_positions()
        >>> where(torch.zeros(1, 3, dtype=torch.long))
        tensor([[  0, 100, 200]])
    """
    ctx = find_context(axis)
    if ctx is None:
        where = "" if axis is None else f" over axis {axis!r}"
        raise RuntimeError(
            f"seq_positions: not inside a shard_map_seq{where}; call it from the function that "
            f"ps.shard_map_seq maps (or a model run under ps.sequence_parallel)"
        )
    return ctx.positions()

"""The sequence context: which layout this rank's tokens are in, while a sequence is split.

``shard_map_seq`` (and the ``sequence_parallel`` hooks) enter a context for the duration of the
mapped function; attention functions and :func:`seq_positions` read it to learn the true global
position of every local token and which tokens are padding. It is a context variable holding a
stack, so nested maps see their own layout and everything is restored on exit (also on
exceptions).

**Recomputation in the backward pass.** Activation checkpointing (``torch.utils.checkpoint``,
reentrant or not) runs parts of ``fn`` again during the backward pass, long after the map has
returned, so the context variable is empty by then, and the backward pass may run on another
thread (the autograd engine's device threads), where context variables do not reach. The map
therefore records its context with the forward (:func:`record_for_backward`,
:mod:`pshard._modules.passes`): the backward pass through the map's outputs files it, and during
that pass :func:`find_context` finds it there when the context variable has none. Several maps
in one backward pass are told apart by their axis and, for the attention functions, by the
number of local tokens they are given; when two *different* contexts still fit (say, sequences
of 7 and 8 tokens, both 4 per rank on 2 ranks) a recompute cannot tell which it belongs to and
:func:`find_context` raises rather than guessing. A context of a ``sequence_parallel`` call also
enters the call's ``backward_scope`` for the pass (``CallState.backward_scope``: the model's
attention plugged again), undone when the pass ends.

Internal interface:

- ``SeqContext(axis, layout, rank, device, mesh, call)``: one entry (``axis`` as a tuple of
  mesh-axis names, or a ``ProcessGroup``); ``positions()`` gives this rank's positions as an
  int64 tensor.
- ``CallState``: what a context carries of the ``sequence_parallel`` call it belongs to;
  ``SeqAttention``: the attention that call plugged into the model, if any.
- ``sequence_context(ctx)``: context manager pushing ``ctx``.
- ``find_context(axis, local_length=None)``: the innermost entry for ``axis`` (``None`` when
  there is none); ``local_length`` (the caller's tokens) tells recorded entries apart.
- ``record_for_backward(tree, ctx)``: the identity on ``tree`` that makes ``ctx`` findable
  while the backward pass through it runs.
- ``context_scope(ctx)``: ``use_mesh(ctx.mesh)`` (a no-op for ``None`` or a context without
  a mesh), so that axes resolve in the map's mesh during a recompute too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._modules.passes import record_for_backward as record
from .._modules.passes import recorded
from .._runtime.mesh import Axis, use_mesh
from ._layouts import SeqLayout

__all__ = [
    "CallState",
    "SeqAttention",
    "SeqContext",
    "context_scope",
    "find_context",
    "normalize_axis",
    "record_for_backward",
    "seq_positions",
    "sequence_context",
]

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


@dataclasses.dataclass(frozen=True, eq=False)
class SeqAttention:
    """The sequence-parallel attention ``sequence_parallel(model, attention=...)`` plugged into
    the model, for one call: ``kind`` (``"ulysses"``, ``"ring"`` or ``"usp"``), the call's
    ``axis`` (normalised; ``(ring_axis, ulysses_axis)`` for ``"usp"``) and this rank's segment
    ids (``(batch, local tokens)``, or ``None``). :func:`pshard.sequence.plug.run_attention`
    runs it."""

    kind: str
    axis: tuple[str, ...]
    segment_ids: torch.Tensor | None


class CallState(Protocol):
    """What a sequence context carries of the ``sequence_parallel`` call it belongs to (the
    hooks' per-call state, compared by identity).

    Attributes:
        attended: how many sequence-parallel attention calls ran during the call (the attention
            functions count themselves, through :meth:`SeqContext.attended`).
        attention: the attention plugged into the model for the call, or ``None``.
    """

    attended: int

    @property
    def attention(self) -> SeqAttention | None: ...

    def backward_scope(self) -> Callable[[], None] | None:
        """Runs when a backward pass through the call begins (its first recorded output is
        differentiated); returns what to undo when that pass ends, or ``None``."""
        ...


@dataclasses.dataclass(frozen=True)
class SeqContext:
    """This rank's part of one split sequence.

    Attributes:
        axis: the axis the sequence is split over (normalised, see :func:`normalize_axis`).
        layout: the layout (true length, padding, permutation).
        rank: this rank's index on the axis.
        device: where position tensors are made.
        mesh: the mesh ``axis`` names axes of (``None``: the current mesh).
        call: the ``sequence_parallel`` call the context belongs to, or ``None``.
    """

    axis: tuple[str, ...] | dist.ProcessGroup
    layout: SeqLayout
    rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    call: CallState | None = None

    def attended(self) -> None:
        """Note that a sequence-parallel attention ran in this context."""
        if self.call is not None:
            self.call.attended += 1

    def backward_scope(self) -> Callable[[], None] | None:
        """What a backward pass through the map enters (the call's scope, see
        :class:`CallState`)."""
        return None if self.call is None else self.call.backward_scope()

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


def record_for_backward(tree: Any, ctx: SeqContext) -> Any:
    """``tree`` with every floating tensor passed through an identity whose backward makes
    ``ctx`` findable (by :func:`find_context`) for the rest of that backward pass."""
    return record(tree, ctx)


def _recorded(axis: Axis | None, local_length: int | None) -> SeqContext | None:
    """The context a running backward pass recorded for ``axis``, for a recompute."""
    live = [entry for entry in recorded() if isinstance(entry, SeqContext)]
    key = None if axis is None else normalize_axis(axis)
    found = [ctx for ctx in live if key is None or ctx.axis == key]
    if len(found) > 1 and local_length is not None:
        found = [ctx for ctx in found if ctx.layout.local_length == local_length] or found
    if len(found) > 1:
        layouts = ", ".join(f"{c.layout.kind} layout of {c.layout.length} tokens" for c in found)
        raise RuntimeError(
            f"pshard: a function is being recomputed in the backward pass (activation "
            f"checkpointing) while {len(found)} different sequence layouts of axis "
            f"{found[0].axis!r} are being differentiated in it ({layouts}), so it cannot tell "
            f"which one it belongs to; differentiate those maps in separate backward passes, "
            f"or checkpoint outside the maps"
        )
    return found[0] if found else None


def find_context(axis: Axis | None = None, local_length: int | None = None) -> SeqContext | None:
    """The innermost context for ``axis`` (any axis when ``None``), or ``None``; during a
    backward pass, the one its map recorded (see the module docs)."""
    stack = _STACK.get()
    if axis is None and stack:
        return stack[-1]
    key = None if axis is None else normalize_axis(axis)
    for ctx in reversed(stack):
        if ctx.axis == key:
            return ctx
    return _recorded(axis, local_length)


def context_scope(ctx: SeqContext | None) -> contextlib.AbstractContextManager[Any]:
    """``use_mesh(ctx.mesh)``, or nothing when there is no context or it has no mesh."""
    if ctx is None or ctx.mesh is None:
        return contextlib.nullcontext()
    return use_mesh(ctx.mesh)


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

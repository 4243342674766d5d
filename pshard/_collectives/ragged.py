"""``ps.ragged_all_to_all``: rows of uneven counts sent to the ranks of an axis (JAX's
``ragged_all_to_all`` with the offsets computed from the counts), the exchange of expert
parallelism.

The counts go first, with a check of every rank's, in one small all-gather
(:func:`pshard._runtime.wire.ragged_counts`): a rank whose ``send_counts`` are wrong (length,
sum, sign) makes every rank raise the same ``ValueError`` before any data moves (never a hang
on rows that never come). The rows then go pairwise
(:func:`pshard._runtime.wire.ragged_exchange`). The transpose is the reverse exchange (the rows
received sent back where they came from); forward-mode tangents take the same exchange. While
``ps.jit`` traces, the counts are data of the program: one ``pshard::ragged_all_to_all`` node
does both steps when it runs, its output's rows a size the data decide.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.tree import describe
from .._runtime import wire
from .._runtime.debug import check_collective
from .._runtime.mesh import Axis
from .._runtime.tracing import active_trace
from .._runtime.wire import Comm
from .._runtime.wire import comm as _comm
from .apply import call, eager_rules

__all__ = ["ragged_all_to_all"]

_FN = "ragged_all_to_all"


class _Ragged(torch.autograd.Function):
    """``(x, c, send, recv) -> y``: the rows exchanged (counts as tuples of ints)."""

    @staticmethod
    def forward(x: torch.Tensor, c: Comm, send: tuple[int, ...], recv: tuple[int, ...]) -> Any:
        return wire.ragged_exchange(x, c, send, recv)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.c, ctx.send, ctx.recv = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return call(_Ragged, g, ctx.c, ctx.recv, ctx.send), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return call(_Ragged, t, ctx.c, ctx.send, ctx.recv)


eager_rules(_Ragged)


class _Traced(torch.autograd.Function):
    """``(x, send_counts, c) -> (y, recv_counts)`` while a program is traced: the counts are
    tensors (data of the program), the rows received as many as they say."""

    @staticmethod
    def forward(x: torch.Tensor, send: torch.Tensor, c: Comm) -> Any:
        return wire.ragged(x, send, c)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.c = inputs[2]
        ctx.save_for_backward(inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[Any, ...]:
        _send, recv = ctx.saved_tensors
        return call(_Traced, g, recv, ctx.c)[0], None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> Any:
        send, _recv = ctx.saved_tensors
        return call(_Traced, t, send, ctx.c)[0], None


def ragged_all_to_all(x: torch.Tensor, send_counts: torch.Tensor, axis: Axis) -> Any:
    """Send ``send_counts[i]`` rows of ``x`` to rank ``i`` of ``axis``; receive the rows every
    rank sends here.

    ``x``'s rows are grouped by destination, in rank order (the first ``send_counts[0]`` rows go
    to rank 0, ...); counts may be uneven or zero (a rank sending nothing to some, or to all).
    The received rows ``y`` are grouped by source rank in rank order, ``recv_counts[i]`` of them
    from rank ``i`` (JAX's ``ragged_all_to_all`` with the offsets computed for you). The counts
    are exchanged first, as one small collective that also checks every rank's.

    Differentiable under ``torch.func.grad``, ``vjp``, ``jvp`` and ``.backward()``: the
    transpose sends the cotangents of ``y`` back where the rows came from.

    Args:
        x: the rows to send, of any trailing shape.
        send_counts: a 1-D integer tensor of the axis size (rows for each rank), summing to
            ``x.shape[0]``.
        axis: a mesh-axis name of the current mesh, a tuple of names, or a ``ProcessGroup``.

    Returns:
        ``(y, recv_counts)``: the rows received and their counts per source rank (a tensor of
        ``send_counts``' dtype and device).

    Raises:
        ValueError: on every rank, before any data moves, when the counts of any rank are of
            the wrong length, negative, or do not sum to its rows (naming ``send_counts`` and
            the ranks).
        TypeError: ``x`` is not a tensor.

    Example:
        >>> import torch, pshard as ps
        >>> mesh = ps.init_mesh({"ep": 1})
        >>> y, counts = ps.ragged_all_to_all(torch.arange(6.0).reshape(3, 2),
        ...                                  torch.tensor([3]), "ep")
        >>> y.shape, counts
        (torch.Size([3, 2]), tensor([3]))
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"{_FN}: x must be a tensor with a dim of rows, got {describe(x)}")
    c = _comm(axis, _FN)
    if active_trace() is not None and c.group is not None:  # ps.jit: the counts are data
        if not isinstance(send_counts, torch.Tensor):
            raise TypeError(f"{_FN}: send_counts must be a tensor, got {describe(send_counts)}")
        return call(_Traced, x, send_counts, c)
    if c.debug and c.group is not None:
        check_collective(_FN, c.group, c.name, x[:0])
    send, recv = wire.ragged_counts(send_counts, x.shape[0], c, _FN)
    dtype = send_counts.dtype if isinstance(send_counts, torch.Tensor) else torch.int64
    device = send_counts.device if isinstance(send_counts, torch.Tensor) else x.device
    if c.group is None:
        return x, torch.tensor(send, dtype=dtype, device=device)
    y = call(_Ragged, x, c, send, recv)
    return y, torch.tensor(recv, dtype=dtype, device=device)

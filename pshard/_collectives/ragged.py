"""``ps.ragged_all_to_all``: rows of uneven counts sent to the ranks of an axis (JAX's
``ragged_all_to_all`` with the offsets computed from the counts), the exchange of expert
parallelism.

The counts go first, with a check of every rank's, in one small all-gather: a rank whose
``send_counts`` are wrong (length, sum, sign) makes every rank raise the same ``ValueError``
before any data moves (never a hang on rows that never come). The rows then go pairwise
(:func:`pshard._runtime.wire.ragged_exchange`). The transpose is the reverse exchange (the rows
received sent back where they came from); forward-mode tangents take the same exchange.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.tree import describe
from .._runtime import wire
from .._runtime.debug import check_collective
from .._runtime.mesh import Axis
from .._runtime.tracing import refuse
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


def _row(send_counts: Any, rows: int, size: int) -> tuple[list[int], str]:
    """This rank's counts and what is wrong with them ("" when nothing is)."""
    if not isinstance(send_counts, torch.Tensor) or send_counts.dim() != 1:
        return [0] * size, f"is {describe(send_counts)}, not a 1-D integer tensor"
    if send_counts.is_floating_point() or send_counts.is_complex():
        return [0] * size, f"has dtype {send_counts.dtype}, not an integer dtype"
    counts = [int(v) for v in send_counts.tolist()]
    if len(counts) != size:
        return [0] * size, f"has {len(counts)} entries, but the axis has {size} ranks"
    if any(v < 0 for v in counts):
        return [0] * size, f"has a negative count ({counts})"
    if sum(counts) != rows:
        return [0] * size, f"sums to {sum(counts)}, but x has {rows} rows"
    return counts, ""


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
    refuse(_FN, "the rows each rank receives are data (their counts decide the output's shape)")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"{_FN}: x must be a tensor with a dim of rows, got {describe(x)}")
    c = _comm(axis, _FN)
    counts, wrong = _row(send_counts, x.shape[0], c.size)
    dtype = send_counts.dtype if isinstance(send_counts, torch.Tensor) else torch.int64
    device = send_counts.device if isinstance(send_counts, torch.Tensor) else x.device
    if c.group is None:
        if wrong:
            raise ValueError(f"{_FN}: send_counts on rank 0 {wrong}")
        return x, torch.tensor(counts, dtype=dtype, device=device)
    if c.debug:
        check_collective(_FN, c.group, c.name, x[:0])
    row = torch.tensor([0 if wrong else 1, *counts], dtype=torch.int64, device=x.device)
    table = wire.all_gather(row, c, 0, False).tolist()  # (ranks, 1 + size)
    bad = [r for r, t in enumerate(table) if not t[0]]
    if bad:
        mine = f" (here, rank {c.rank}: send_counts {wrong})" if wrong else ""
        raise ValueError(
            f"{_FN}: send_counts are wrong on rank{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))} of axis {c.name!r}{mine}: each rank passes a 1-D "
            f"integer tensor of {c.size} counts, none negative, summing to its x's rows; no "
            f"rows were sent"
        )
    recv = tuple(int(table[src][1 + c.rank]) for src in range(c.size))
    y = call(_Ragged, x, c, tuple(counts), recv)
    return y, torch.tensor(recv, dtype=dtype, device=device)

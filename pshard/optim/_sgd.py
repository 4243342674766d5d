"""Stochastic gradient descent with optional (Nesterov) momentum: optax's ``sgd``, one fused
transform (optax chains ``trace`` and ``scale_by_learning_rate``)::

    trace = g + momentum * trace                 (starts at zeros: the first trace is g)
    direction = g + momentum * trace if nesterov else trace
    updates = -learning_rate(count) * direction

``torch.optim.SGD`` with ``dampening=0`` takes the same steps (its first buffer is ``g``).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from .._core.tree import describe
from . import _kernels as kernels
from ._base import (
    GradientTransformation,
    Schedule,
    as_state,
    check_number,
    check_rate,
    count_of,
    new_count,
    next_count,
    rate_at,
)
from ._leaves import cast, check_like, flatten, groups

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """The state of :func:`sgd`.

    Attributes:
        count: the number of updates applied (a 0-d int64 tensor on the CPU; what a schedule
            is called with).
        trace: the momentum buffers, a tree like the parameters (``GlobalTensor`` s of their
            parameters' layouts on trees of ``GlobalTensor`` s); ``None`` without momentum.
    """

    count: torch.Tensor  # type: ignore[assignment]  # (shadows tuple.count, as in optax)
    trace: Any


def sgd(
    learning_rate: float | Schedule, momentum: float | None = None, nesterov: bool = False
) -> GradientTransformation:
    """SGD (optax's ``sgd``): ``updates = -learning_rate(count) * g``, or with ``momentum`` a
    trace ``trace = g + momentum * trace`` and ``updates = -lr * trace`` (``nesterov``:
    ``-lr * (g + momentum * trace)``).

    Args:
        learning_rate: a float, or a schedule ``count -> float`` (0 at the first update).
        momentum: the trace's decay; ``None``: no trace kept.
        nesterov: Nesterov momentum.

    Returns:
        A ``GradientTransformation`` whose state is an :class:`SgdState`;
        ``update(..., donate=True)`` writes the trace (and the updates, into the gradients'
        tensors) in place.

    Example:
        >>> import torch, pshard as ps
        >>> tx = ps.optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.zeros(2)}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.ones(2)}, state)
        >>> updates["w"]                                   # -0.1 * (1 + 0.9 * 1)
        tensor([-0.1900, -0.1900])
    """
    fn = "sgd"
    check_rate(learning_rate, fn)
    decay = None if momentum is None else check_number(momentum, fn, "momentum")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{fn}: nesterov must be a bool, got {describe(nesterov)}")
    if nesterov and decay is None:
        raise ValueError(f"{fn}: nesterov=True needs a momentum (e.g. momentum=0.9)")

    def init(params: Any) -> SgdState:
        p = flatten(params, fn, "params")
        p.check_floating(fn)
        if decay is None:
            return SgdState(new_count(), None)
        return SgdState(new_count(), p.rebuild([torch.zeros_like(b) for b in p.blocks]))

    def update(
        updates: Any, state: Any, params: Any = None, *, donate: bool = False
    ) -> tuple[Any, SgdState]:
        state = as_state(state, SgdState, fn)
        lr = rate_at(learning_rate, count_of(state.count, fn), fn)
        g = flatten(updates, fn, "grads")
        g.check_floating(fn)
        out: list[torch.Tensor] = list(g.blocks)
        if decay is None:
            with torch.no_grad() if donate else contextlib.nullcontext():
                for idx in groups([(b.device, b.dtype) for b in g.blocks]):
                    gs = [g.blocks[i] for i in idx]
                    if donate:
                        kernels.mul_(gs, -lr)
                        us = gs
                    else:
                        us = kernels.mul(gs, -lr)
                    for j, i in enumerate(idx):
                        out[i] = us[j]
            return g.rebuild(out), SgdState(next_count(state.count), None)
        tr = flatten(state.trace, fn, "state.trace")
        check_like(g, tr, fn, "pass gradients of the params this state was made from")
        new_trace = list(tr.blocks)
        with torch.no_grad() if donate else contextlib.nullcontext():
            for idx in groups([(b.device, b.dtype) for b in tr.blocks]):
                dtype = tr.blocks[idx[0]].dtype
                gs = cast(g.blocks, idx, dtype)
                ts = [tr.blocks[i] for i in idx]
                if donate:
                    kernels.mul_(ts, decay)
                    kernels.add_(ts, gs)
                else:
                    ts = kernels.add(gs, ts, alpha=decay)
                if nesterov:
                    if donate:
                        kernels.add_(gs, ts, alpha=decay)
                        us = gs
                    else:
                        us = kernels.add(gs, ts, alpha=decay)
                    kernels.mul_(us, -lr)
                else:
                    us = kernels.mul(ts, -lr)
                for j, i in enumerate(idx):
                    new_trace[i], out[i] = ts[j], us[j]
        return g.rebuild(out), SgdState(next_count(state.count), tr.rebuild(new_trace))

    return GradientTransformation(init, update)

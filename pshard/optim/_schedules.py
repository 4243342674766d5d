"""Learning-rate schedules: optax's formulas as plain Python functions of the step count.

A schedule is ``count -> float``, ``count`` the number of updates already applied (0 at the
first update, as optax's ``scale_by_schedule`` calls it). The values are optax's at float64
(``jax_enable_x64``); they are computed in Python floats, so reading one costs no device sync.
Called with a tensor count (a traced step: ``ps.jit``), the same formulas in float64 tensor
operations give a 0-d tensor, so one program serves every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._core.checks import check_int
from ._base import Schedule, check_number

__all__ = ["cosine_decay_schedule", "linear_schedule", "warmup_cosine_decay_schedule"]


def _constant(value: float, count: Any) -> Any:
    """``value``, as a 0-d float64 tensor for a tensor count."""
    if isinstance(count, torch.Tensor):
        return torch.full((), value, dtype=torch.float64, device=count.device)
    return value


def _steps(value: object, fn: str, arg: str) -> int:
    return check_int(fn, arg, value)


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """From ``init_value`` to ``end_value`` in a straight line over ``transition_steps``
    updates, starting after ``transition_begin`` (optax's ``linear_schedule``)::

        c = min(max(count - transition_begin, 0), transition_steps)
        value = (init_value - end_value) * (1 - c / transition_steps) + end_value

    ``transition_steps <= 0`` holds ``init_value`` throughout (as optax does); a negative
    ``transition_begin`` counts as 0.

    Example:
        >>> import pshard as ps
        >>> s = ps.optim.linear_schedule(1.0, 0.0, transition_steps=4)
        >>> [s(t) for t in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    fn = "linear_schedule"
    init = check_number(init_value, fn, "init_value")
    end = check_number(end_value, fn, "end_value")
    steps = _steps(transition_steps, fn, "transition_steps")
    begin = max(_steps(transition_begin, fn, "transition_begin"), 0)
    if steps <= 0:
        return lambda count: _constant(init, count)

    def schedule(count: Any) -> Any:
        if isinstance(count, torch.Tensor):
            t = (count - begin).clamp(0, steps).to(torch.float64)
            return (init - end) * (1 - t / steps) + end
        c = min(max(count - begin, 0), steps)
        return (init - end) * (1 - c / steps) + end

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` updates
    (optax's ``cosine_decay_schedule``)::

        c = min(count, decay_steps)
        value = init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * c / decay_steps))) ** exponent
                              + alpha)

    Raises:
        ValueError: ``decay_steps`` is not positive.

    Example:
        >>> import pshard as ps
        >>> s = ps.optim.cosine_decay_schedule(1.0, decay_steps=2)
        >>> [round(s(t), 6) for t in range(4)]
        [1.0, 0.5, 0.0, 0.0]
    """
    fn = "cosine_decay_schedule"
    init = check_number(init_value, fn, "init_value")
    steps = _steps(decay_steps, fn, "decay_steps")
    a = check_number(alpha, fn, "alpha")
    power = check_number(exponent, fn, "exponent")
    if steps <= 0:
        raise ValueError(f"{fn}: decay_steps must be positive, got {steps}")

    def schedule(count: Any) -> Any:
        if isinstance(count, torch.Tensor):
            t = count.clamp(max=steps).to(torch.float64)
            wave = 0.5 * (1 + torch.cos(math.pi * t / steps))
            return init * ((1 - a) * wave**power + a)
        c = min(count, steps)
        cosine = 0.5 * (1 + math.cos(math.pi * c / steps))
        return init * ((1 - a) * cosine**power + a)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps`` updates,
    then a cosine decay to ``end_value`` that ends ``decay_steps`` updates after the start
    (optax's ``warmup_cosine_decay_schedule``: ``decay_steps`` includes the warmup)::

        count < warmup_steps: linear_schedule(init_value, peak_value, warmup_steps)(count)
        otherwise:            cosine_decay_schedule(peak_value, decay_steps - warmup_steps,
                                  alpha=end_value / peak_value, exponent)(count - warmup_steps)

    (``alpha`` is 0 when ``peak_value`` is 0.)

    Raises:
        ValueError: ``decay_steps`` is not greater than ``warmup_steps``.

    Example:
        >>> import pshard as ps
        >>> s = ps.optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=4)
        >>> [round(s(t), 6) for t in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    fn = "warmup_cosine_decay_schedule"
    peak = check_number(peak_value, fn, "peak_value")
    end = check_number(end_value, fn, "end_value")
    warmup = _steps(warmup_steps, fn, "warmup_steps")
    total = _steps(decay_steps, fn, "decay_steps")
    if total - warmup <= 0:
        raise ValueError(
            f"{fn}: decay_steps ({total}) must be greater than warmup_steps ({warmup}): it is "
            f"the length of the whole schedule, warmup included"
        )
    rise = linear_schedule(init_value, peak, warmup)
    decay = cosine_decay_schedule(
        peak, total - warmup, 0.0 if peak == 0.0 else end / peak, exponent
    )

    def schedule(count: Any) -> Any:
        if isinstance(count, torch.Tensor):
            return torch.where(count < warmup, rise(count), decay(count - warmup))
        return rise(count) if count < warmup else decay(count - warmup)

    return schedule

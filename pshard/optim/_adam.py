"""Adam and AdamW: optax's update rules, fused into one pass of torch's multi-tensor kernels.

optax writes ``adamw`` as ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask),
scale_by_learning_rate(learning_rate))``; here the three are one transform (one state, one
walk over the blocks, no intermediate trees), with the same numbers::

    t = count + 1
    mu = b1 * mu + (1 - b1) * g              (torch: mu.lerp_(g, 1 - b1))
    nu = b2 * nu + (1 - b2) * g * g
    u = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t)) + eps) + weight_decay * p   (masked)
    updates = -learning_rate(count) * u

computed as ``-lr * sqrt(1 - b2**t) / (1 - b1**t) * mu / (sqrt(nu) + eps * sqrt(1 - b2**t))
- lr * weight_decay * p`` (the bias corrections folded into two scalars: equal to rounding,
one pass over the blocks fewer).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import numpy as np
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
from ._leaves import Flat, cast, check_like, flatten, groups, prefix_flat

__all__ = ["ScaleByAdamState", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """The state of :func:`adam` and :func:`adamw` (optax's ``ScaleByAdamState``).

    Attributes:
        count: the number of updates applied (a 0-d int64 tensor on the CPU, as
            ``torch.optim`` keeps its step: schedules and bias corrections read it without a
            device sync; while traced they compute with it).
        mu: the first moments, a tree like the parameters (each a ``GlobalTensor`` of its
            parameter's layout on trees of ``GlobalTensor`` s).
        nu: the second moments, likewise.
    """

    count: torch.Tensor  # type: ignore[assignment]  # (shadows tuple.count, as in optax)
    mu: Any
    nu: Any


def _flags(mask: Any, params: Any, p: Flat, fn: str) -> list[bool]:
    """Which leaves decay: ``mask`` (a prefix tree of bools, or a function of the params
    returning one) broadcast over the parameters' leaves."""
    if mask is None:
        return [True] * len(p.blocks)
    tree = mask(params) if callable(mask) else mask
    try:
        flags = prefix_flat(tree, p, "mask", fn)
    except ValueError as e:
        raise ValueError(
            f"{e}; the mask is a tree of bools with the params' structure or a prefix of it"
        ) from None
    for i, flag in enumerate(flags):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{fn} mask for {p.where(i)}: {describe(flag)}; the mask's leaves are bools "
                f"(True: the leaf decays), in a tree with the params' structure or a prefix of it"
            )
    return [bool(f) for f in flags]


def _updates(
    mus: list[torch.Tensor],
    denom: list[torch.Tensor],
    ps_: list[torch.Tensor] | None,
    step: Any,
    decay: Any,
) -> list[torch.Tensor]:
    """``-step * mu / denom - decay * p`` (no decay term without ``ps_``). On the CPU, where
    torch's multi-tensor kernels are loops over the tensors anyway, in ``denom``'s own tensors
    (one allocation fewer: a fresh page costs more than a pass there); elsewhere in new tensors,
    one multi-tensor kernel each. ``step`` and ``decay`` are floats, or 0-d tensors while
    traced (then computed with the kernels' tensor forms)."""
    if isinstance(step, torch.Tensor):
        traced: list[torch.Tensor] = kernels.mul(mus, -step)
        kernels.div_(traced, denom)
        if ps_ is not None:
            kernels.add_(traced, kernels.mul(ps_, -decay))
        return traced
    if denom and denom[0].device.type == "cpu":
        for m, d in zip(mus, denom, strict=True):
            torch.div(m, d, out=d)
        kernels.mul_(denom, -step)
        if ps_ is not None:
            kernels.add_(denom, ps_, alpha=-decay)
        return denom
    if ps_ is not None:
        us: list[torch.Tensor] = kernels.mul(ps_, -decay)
        kernels.addcdiv_(us, mus, denom, -step)
        return us
    us = kernels.mul(mus, -step)
    kernels.div_(us, denom)
    return us


def _scale_by_adam(
    fn: str,
    learning_rate: float | Schedule,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask: Any,
) -> GradientTransformation:
    check_rate(learning_rate, fn)
    b1 = check_number(b1, fn, "b1")
    b2 = check_number(b2, fn, "b2")
    eps = check_number(eps, fn, "eps")
    weight_decay = check_number(weight_decay, fn, "weight_decay")
    fix = "pass gradients of the params this state was made from (tx.init(params))"

    def init(params: Any) -> ScaleByAdamState:
        p = flatten(params, fn, "params")
        p.check_floating(fn)
        if weight_decay:
            _flags(mask, params, p, fn)  # a mask that does not fit fails here already
        mu = p.rebuild([torch.zeros_like(b) for b in p.blocks])
        nu = p.rebuild([torch.zeros_like(b) for b in p.blocks])
        return ScaleByAdamState(new_count(), mu, nu)

    def update(
        updates: Any, state: Any, params: Any = None, *, donate: bool = False
    ) -> tuple[Any, ScaleByAdamState]:
        state = as_state(state, ScaleByAdamState, fn)
        count = count_of(state.count, fn)
        m = flatten(state.mu, fn, "state.mu")
        v = flatten(state.nu, fn, "state.nu")
        g = flatten(updates, fn, "grads")
        g.check_floating(fn)
        check_like(g, m, fn, fix)
        check_like(v, m, fn, "the state is not one this transform made")
        decays = [False] * len(m.blocks)
        p: Flat | None = None
        if weight_decay:
            if params is None:
                raise ValueError(
                    f"{fn}: weight decay reads the parameters, but params is None; call "
                    f"update(grads, state, params)"
                )
            p = flatten(params, fn, "params")
            check_like(p, m, fn, "pass the params this state was made from")
            decays = _flags(mask, params, p, fn)

        lr = rate_at(learning_rate, count, fn)
        if isinstance(count, torch.Tensor):  # traced: the scalars computed in the program
            t = (count + 1).to(torch.float64)
            root_t = torch.sqrt(1 - torch.pow(b2, t))
            step: Any = lr * root_t / (1 - torch.pow(b1, t))
            tiny: Any = eps * root_t
        else:
            root = math.sqrt(1 - b2 ** (count + 1))
            step = lr * root / (1 - b1 ** (count + 1))
            tiny = eps * root
        new_mu, new_nu = list(m.blocks), list(v.blocks)
        out: list[torch.Tensor] = list(g.blocks)
        with torch.no_grad() if donate else contextlib.nullcontext():
            for idx in groups([(b.device, b.dtype, decays[i]) for i, b in enumerate(m.blocks)]):
                dtype = m.blocks[idx[0]].dtype
                gs = cast(g.blocks, idx, dtype)
                mus, nus = [m.blocks[i] for i in idx], [v.blocks[i] for i in idx]
                if donate:
                    kernels.lerp_(mus, gs, 1 - b1)
                    kernels.mul_(nus, b2)
                else:
                    mus, nus = kernels.lerp(mus, gs, 1 - b1), kernels.mul(nus, b2)
                kernels.addcmul_(nus, gs, gs, 1 - b2)
                denom = kernels.sqrt(nus)
                kernels.add_(denom, tiny)
                ps_ = cast(p.blocks, idx, dtype) if decays[idx[0]] and p is not None else None
                us = _updates(mus, denom, ps_, step, lr * weight_decay)
                for j, i in enumerate(idx):
                    new_mu[i], new_nu[i], out[i] = mus[j], nus[j], us[j]
        state_count = next_count(state.count)
        return g.rebuild(out), ScaleByAdamState(state_count, m.rebuild(new_mu), v.rebuild(new_nu))

    return GradientTransformation(init, update)


def adam(
    learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformation:
    """Adam (optax's ``adam``; ``torch.optim.Adam``'s update)::

        mu = b1 * mu + (1 - b1) * g;   nu = b2 * nu + (1 - b2) * g**2;   t = count + 1
        updates = -learning_rate(count) * (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t)) + eps)

    Args:
        learning_rate: a float, or a schedule ``count -> float`` (0 at the first update).
        b1, b2: the moments' decay rates.
        eps: added to the root of the second moment.

    Returns:
        A ``GradientTransformation`` whose state is a :class:`ScaleByAdamState`; on trees of
        ``GlobalTensor`` s each moment is a ``GlobalTensor`` of its parameter's layout and the
        math runs on the blocks. ``update(..., donate=True)`` writes the moments in place.

    Example:
        >>> import torch, pshard as ps
        >>> tx = ps.optim.adam(0.1)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -3.0])}, tx.init(params))
        >>> updates["w"], state.count
        (tensor([-0.1000,  0.1000]), tensor(1))
    """
    return _scale_by_adam("adam", learning_rate, b1, b2, eps, 0.0, None)


def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW, Adam with decoupled weight decay (optax's ``adamw``; ``torch.optim.AdamW``'s
    update)::

        updates = -learning_rate(count) * (adam_direction + weight_decay * params)

    with ``adam_direction`` that of :func:`adam`. ``torch.optim.AdamW`` applies the same step
    (it multiplies the parameters by ``1 - lr * weight_decay`` first); note that its default
    ``weight_decay`` is 1e-2 and optax's (and this one's) 1e-4.

    Args:
        learning_rate: a float, or a schedule ``count -> float`` (0 at the first update).
        b1, b2, eps: as :func:`adam`.
        weight_decay: the decay rate (times the learning rate).
        mask: which parameters decay: a tree of bools with the params' structure or a prefix
            of it (``{"w": True, "norm": False}``; one bool covers a whole subtree), or a
            function of the params returning one; ``None``: all.

    Returns:
        A ``GradientTransformation`` whose state is a :class:`ScaleByAdamState`; ``update``
        needs ``params`` (unless ``weight_decay`` is 0). ``update(..., donate=True)`` writes
        the moments in place.

    Raises:
        ValueError: a mask tree that does not fit the params (naming the key path).
        TypeError: a mask leaf that is not a bool.

    Example:
        >>> import torch, pshard as ps
        >>> tx = ps.optim.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
        >>> params = {"w": torch.tensor([1.0]), "b": torch.tensor([1.0])}
        >>> grads = {"w": torch.tensor([2.0]), "b": torch.tensor([2.0])}
        >>> updates, state = tx.update(grads, tx.init(params), params)
        >>> updates                                       # w also decays by 0.1 * 0.5 * 1.0
        {'w': tensor([-0.1500]), 'b': tensor([-0.1000])}
    """
    return _scale_by_adam("adamw", learning_rate, b1, b2, eps, weight_decay, mask)

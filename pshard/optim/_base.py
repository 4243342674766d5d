"""What every transform shares: the ``GradientTransformation`` pair, ``chain``,
``apply_updates``, learning rates that are schedules, and donation.

A transform is optax's pair of pure functions: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``. pshard's own transforms also take
``donate=False`` (keyword-only): with ``donate=True`` the caller hands over the tensors of the
old ``state`` and of the incoming ``updates`` (JAX's ``donate_argnums``), and the kernels write
the new state (and, where they can, the updates) into them in place instead of allocating new
tensors; the caller must not read what it donated afterwards. :func:`apply_updates` takes
``donate=True`` for the parameters.

**The step count** in a state is a 0-d integer tensor on the CPU (optax keeps an array): in
eager code the transforms read it as an int (no device sync) and compute their scalars (the
learning rate, Adam's bias corrections, clipping's factor) in Python floats; while traced
(``ps.jit``, ``torch.compile``) they compute them with tensor operations on it, so that one
program serves every step. The numbers are the same to rounding.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .._compat import tracing
from .._core.global_tensor import is_global
from .._core.placements import P
from .._core.tree import article, describe
from . import _kernels as kernels
from ._leaves import check_like, flatten, groups

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "Schedule",
    "apply_updates",
    "chain",
    "check_number",
    "check_rate",
    "as_state",
    "count_of",
    "new_count",
    "next_count",
    "traced",
    "rate_at",
    "run_update",
]

Schedule = Callable[[Any], Any]
"""``count -> learning rate``: an int count gives a float, a tensor count a 0-d tensor."""


def new_count() -> torch.Tensor:
    """The count of a new state: 0, a 0-d int64 tensor on the CPU."""
    return torch.zeros((), dtype=torch.int64)


def traced(value: Any) -> bool:
    """Whether ``value`` is a tensor being traced (its value unknown until the program runs)."""
    return isinstance(value, torch.Tensor) and tracing([value])


def count_of(count: Any, fn: str) -> int | torch.Tensor:
    """The state's count to compute with: an int (read on the host), or the tensor itself
    while traced.

    Raises:
        TypeError: not an integer count (a 0-d integer tensor, or an int of an older state).
    """
    if is_global(count) and count.spec == P():  # as ps.load gives it back with specs
        count = count.local
    if (
        isinstance(count, torch.Tensor)
        and count.dim() == 0
        and not (count.is_floating_point() or count.is_complex() or count.dtype == torch.bool)
    ):
        return count if tracing([count]) else int(count)
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    raise TypeError(
        f"{fn}: the state's count is {describe(count)}, not an integer count; pass the state "
        f"init (or the last update, or ps.load) returned"
    )


def next_count(count: Any) -> torch.Tensor:
    """The count after one more update (a tensor, whatever the state held)."""
    if is_global(count):
        count = count.local
    if isinstance(count, torch.Tensor):
        return count + 1
    return torch.tensor(count + 1, dtype=torch.int64)


class GradientTransformation(NamedTuple):
    """A gradient transformation: ``init(params) -> state`` and
    ``update(updates, state, params=None, *, donate=False) -> (updates, state)`` (optax's
    ``GradientTransformation``; any object with these two functions can be chained)."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """The state of a transform that keeps none (optax's ``EmptyState``)."""


def check_number(value: Any, fn: str, arg: str) -> float:
    """``value`` as a float; a ``TypeError`` naming ``fn`` and ``arg`` unless it is a real
    number (not a bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {arg} must be a real number, got {describe(value)}")
    return float(value)


def as_state(state: Any, cls: Any, fn: str) -> Any:
    """``state`` as the transform's state type ``cls`` (a NamedTuple): itself, or rebuilt from
    a mapping of its fields (what ``ps.load`` gives back when ``like`` came from
    ``ps.load_metadata``, which writes NamedTuples as dicts).

    Raises:
        TypeError: anything else, naming ``fn``.
    """
    if isinstance(state, cls):
        return state
    if isinstance(state, Mapping) and set(state) == set(cls._fields):
        return cls(**state)
    raise TypeError(
        f"{fn}: state is {describe(state)}, not {article(cls.__name__)}; pass the state init "
        f"(or the last update, or ps.load) returned"
    )


def check_rate(learning_rate: Any, fn: str) -> None:
    """A learning rate is a real number or a schedule (a callable of the step count)."""
    if not callable(learning_rate):
        check_number(learning_rate, fn, "learning_rate")


def rate_at(learning_rate: float | Schedule, count: int | torch.Tensor, fn: str) -> Any:
    """The learning rate for the update that follows ``count`` applied ones (a schedule is
    called with ``count``, 0 at the first update, as optax's ``scale_by_schedule``): a float
    for an int count; for a traced tensor count a schedule's 0-d tensor.

    Raises:
        TypeError: the schedule returned something other than a real number (or, for a
            tensor count, a 0-d floating tensor).
    """
    if not callable(learning_rate):
        return float(learning_rate)
    value = learning_rate(count)
    if isinstance(count, torch.Tensor):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        raise TypeError(
            f"{fn}: the learning-rate schedule returned {describe(value)} for a tensor step "
            f"count (traced: ps.jit, torch.compile); a schedule returns a 0-d floating tensor "
            f"for a tensor count (compute with torch operations on it)"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (a tensor: return .item())" if isinstance(value, torch.Tensor) else ""
        raise TypeError(
            f"{fn}: the learning-rate schedule returned {describe(value)} for step count "
            f"{count}; a schedule returns a Python float{hint}"
        )
    return float(value)


def _takes_donate(update: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(update).parameters
    except (TypeError, ValueError):
        return False
    return "donate" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def run_update(tx: Any, updates: Any, state: Any, params: Any, donate: bool) -> tuple[Any, Any]:
    """``tx.update(updates, state, params)``, with ``donate=True`` passed on to transforms
    that take it (others allocate, which is always allowed)."""
    if donate and _takes_donate(tx.update):
        out: tuple[Any, Any] = tx.update(updates, state, params, donate=True)
        return out
    out = tx.update(updates, state, params)
    return out


def chain(*transforms: Any) -> GradientTransformation:
    """Apply ``transforms`` one after the other (optax's ``chain``): each one's updates are the
    next one's input; the state is the tuple of their states.

    Args:
        *transforms: ``GradientTransformation`` s (any objects with ``init`` and ``update``).

    Returns:
        The chained transform; ``update(..., donate=True)`` passes the donation on to each
        transform that takes it.

    Example:
        >>> import torch, pshard as ps
        >>> tx = ps.optim.chain(ps.optim.clip_by_global_norm(1.0), ps.optim.sgd(0.5))
        >>> params = {"w": torch.zeros(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([3.0, 4.0])}, state, params)
        >>> updates["w"]                       # clipped to norm 1, then times -0.5
        tensor([-0.3000, -0.4000])
    """
    for i, t in enumerate(transforms):
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise TypeError(
                f"chain: transforms[{i}] is {describe(t)}, not a gradient transformation (an "
                f"object with init and update, such as ps.optim.adamw(1e-3))"
            )

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Any, state: Any, params: Any = None, *, donate: bool = False
    ) -> tuple[Any, tuple[Any, ...]]:
        if isinstance(state, list):  # ps.load_metadata writes tuples as lists
            state = tuple(state)
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain: the state is {describe(state)} but the chain has {len(transforms)} "
                f"transforms (a tuple of one state each); pass the state this chain's init "
                f"(or its last update) returned"
            )
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = run_update(t, updates, s, params, donate)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any, *, donate: bool = False) -> Any:
    """``params + updates``, leaf by leaf, each result in its parameter's dtype (optax's
    ``apply_updates``). On trees of GlobalTensors the blocks are added (the layouts must be
    equal). Pure unless ``donate=True``.

    Args:
        params: a tree of tensors or GlobalTensors.
        updates: a tree of the same structure and layouts (what ``update`` returned).
        donate: write the sums into the parameters' own tensors (in place, without autograd)
            and return them: the caller hands ``params`` over and uses only the result.

    Raises:
        ValueError: ``updates``'s structure or layouts differ from ``params``'s (naming the key
            path); with ``donate=True``, two keys of ``params`` share memory (naming both).

    Example:
        >>> import torch, pshard as ps
        >>> ps.optim.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    fn = "apply_updates"
    p = flatten(params, fn, "params")
    u = flatten(updates, fn, "updates")
    check_like(u, p, fn, "pass the updates that update(grads, state, params) returned")
    if donate:
        p.check_distinct(fn)
    out: list[torch.Tensor] = list(p.blocks)
    keys = [(x.device, x.dtype, y.dtype) for x, y in zip(p.blocks, u.blocks, strict=True)]
    for idx in groups(keys):
        xs, ys = [p.blocks[i] for i in idx], [u.blocks[i] for i in idx]
        if donate:
            with torch.no_grad():
                kernels.add_(xs, ys)
            continue
        sums = kernels.add(xs, ys)
        for i, s in zip(idx, sums, strict=True):
            out[i] = s if s.dtype == p.blocks[i].dtype else s.to(p.blocks[i].dtype)
    return p.rebuild(out)

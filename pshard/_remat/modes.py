"""The global modes of torch that a checkpoint's forward ran under, for its recompute.

A recompute runs during the backward, which may run under other modes than the forward did
(the usual mixed-precision loop runs its forward inside ``torch.autocast`` and calls
``.backward()`` outside it). Each mode here is read when the checkpoint is called
(:func:`capture`) and is either restored for the recompute (:func:`restored`: autocast, per
device type, as ``torch.utils.checkpoint`` restores it) or only compared (:func:`changed`: a
mode that a program sets once, such as the default dtype, which a recompute must not silently
switch back; a recompute under another value is an error naming the mode, before it runs).

What lives in a ``contextvars`` context needs nothing here: the recompute runs in a copy of
the forward's context (:class:`pshard._remat.function.Call`), so every context variable (the
current mesh, debug mode, the sequence context, any context variable added later) is carried
as the forward saw it. This module is for the thread-local modes of torch itself; a new one is
one more :class:`Mode` in :data:`MODES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

__all__ = ["MODES", "Mode", "Modes", "capture", "changed", "restored"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """A global mode: ``read()`` its value now; ``enter(value)`` a context manager that sets it
    (``None``: compared only, never set); ``name`` and ``how`` (how a program changes it) for
    the error; ``show(value)`` the value in words."""

    name: str
    read: Callable[[], Hashable]
    enter: Callable[[Any], contextlib.AbstractContextManager[Any]] | None
    how: str
    show: Callable[[Any], str] = str


def _dtype(d: Any) -> str:
    return str(d).removeprefix("torch.")


def _autocast_state(device_type: str) -> Hashable:
    """``(True, dtype, cache enabled)``, or ``(False,)`` when off (then neither matters)."""
    if not torch.is_autocast_enabled(device_type):
        return (False,)
    return (True, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())


def _autocast_mode(device_type: str) -> Mode:
    def enter(state: Any) -> contextlib.AbstractContextManager[Any]:
        if not state[0]:
            return torch.autocast(device_type, enabled=False)
        _, dtype, cache = state
        return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)

    def show(state: Any) -> str:
        return f"on ({_dtype(state[1])})" if state[0] else "off"

    return Mode(
        f"{device_type} autocast",
        lambda: _autocast_state(device_type),
        enter,
        f"torch.autocast({device_type!r})",
        show,
    )


def _autocast_devices() -> tuple[str, ...]:
    """The device types whose autocast is restored: the CPU's, and CUDA's where torch has it
    (``torch.utils.checkpoint`` restores the same two)."""
    return tuple(d for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))


#: The modes read at each checkpointed call: autocast per device type (restored), then the
#: default dtype (compared).
MODES: tuple[Mode, ...] = (
    *(_autocast_mode(d) for d in _autocast_devices()),
    Mode("default dtype", torch.get_default_dtype, None, "torch.set_default_dtype", _dtype),
)


@dataclasses.dataclass(frozen=True)
class Modes:
    """The values of :data:`MODES` at a forward, in their order."""

    values: tuple[Hashable, ...]


def capture() -> Modes:
    """The modes now (the forward's)."""
    return Modes(tuple(m.read() for m in MODES))


@contextlib.contextmanager
def restored(modes: Modes) -> Iterator[None]:
    """Run a block under the forward's ``modes`` (those :data:`MODES` can set)."""
    with contextlib.ExitStack() as stack:
        for mode, value in zip(MODES, modes.values, strict=True):
            if mode.enter is not None and mode.read() != value:
                stack.enter_context(mode.enter(value))
        yield


def changed(modes: Modes) -> str | None:
    """The modes that are not set back for the recompute and differ now from the forward's
    ``modes``, in words (``None`` if none): the recompute refuses to run under them."""
    parts = [
        f"{mode.name} was {mode.show(before)} in the forward and is {mode.show(now)} in the "
        f"recompute ({mode.how} between the forward and the backward; keep it as the forward "
        f"had it until the backward is done)"
        for mode, before in zip(MODES, modes.values, strict=True)
        if mode.enter is None and (now := mode.read()) != before
    ]
    return "; ".join(parts) if parts else None

"""A trace of pshard code into one program (``ps.jit``), as the wire sees it.

While a :class:`Trace` is active (a context variable: each thread rank has its own), the raw
collectives of :mod:`pshard._runtime.wire` move no data: each returns what the trace's
``emit`` gives for it (a node of the program, an op that communicates when the program runs),
and the trace lists the collectives in program order. What ranks must agree on before the
program exists (block shapes, layouts, the trees they pass) is exchanged for real, once, at
trace time: such exchanges run inside :func:`outside_trace`, with real tensors and the trace
suspended.

Nothing above the wire knows whether it is being traced; the room that traces (``_jit``) makes
the :class:`Trace` and what it emits.

Internal interface: :class:`Trace`, :func:`active_trace`, :func:`tracing`,
:func:`outside_trace`, :func:`refuse`, :class:`NotTraceable`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from .._compat import real_tensors

__all__ = ["NotTraceable", "Trace", "active_trace", "outside_trace", "refuse", "tracing"]


class NotTraceable(RuntimeError):
    """Something that cannot be part of a traced program (I/O, spawning ranks, a data-dependent
    shape), called inside a trace."""


class Trace:
    """One trace: ``emit(name, x, comm, params)`` gives the node of collective ``name`` (one
    of :mod:`pshard._collectives.transposes`' names, or ``"pextreme"``) and ``collectives``
    lists ``(name, axis)`` in program order."""

    def __init__(self, emit: Callable[[str, Any, Any, tuple[Any, ...]], Any]) -> None:
        self._emit = emit
        self.collectives: list[tuple[str, str | tuple[str, ...]]] = []

    def emit(self, name: str, x: Any, c: Any, params: tuple[Any, ...]) -> Any:
        if not c.key:
            raise NotTraceable(
                f"{name} over {c.name!r}: a collective over a process group pshard did not "
                f"resolve from the mesh cannot be traced"
            )
        # each node its own key (``#`` and its place): compilers must not merge two
        # collectives of the same value (a gather in the forward and again in the backward,
        # which FSDP keeps apart so that the gathered weights do not live in between)
        tagged = c._replace(key=f"{c.key}#{len(self.collectives)}")
        self.collectives.append((name, c.name))
        return self._emit(name, x, tagged, params)


_TRACE: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("pshard_trace", default=None)


def active_trace() -> Trace | None:
    """The trace running in this context, or ``None``."""
    return _TRACE.get()


@contextlib.contextmanager
def tracing(trace: Trace | None) -> Iterator[None]:
    """``trace`` active for the block (``None``: none)."""
    token = _TRACE.set(trace)
    try:
        yield
    finally:
        _TRACE.reset(token)


@contextlib.contextmanager
def outside_trace() -> Iterator[None]:
    """Real tensors and real communication for the block, even inside a trace (metadata the
    ranks exchange once, when the program is made). Tensors made inside are real; a traced
    value read inside is an error."""
    if _TRACE.get() is None:
        yield
        return
    with real_tensors(), tracing(None):
        yield


def refuse(what: str, why: str) -> None:
    """Raise :class:`NotTraceable` if a trace is active: ``what`` cannot be traced because
    ``why``."""
    if _TRACE.get() is not None:
        raise NotTraceable(f"{what} cannot be part of a ps.jit program: {why}")

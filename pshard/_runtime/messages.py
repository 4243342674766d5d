"""What a caller and its worker processes say to each other, and the errors it raises from them.

A :class:`~pshard._runtime.gang.Gang`'s caller sends each worker a pickled :class:`Task` (or
``None``: stop); the worker answers with a pickled :class:`Ready` once it has joined the process
group, then one :class:`Done` or :class:`Failed` per task. Each answer carries the worker's
:class:`Health`, which tells the caller whether the gang can run another task.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._core.global_tensor import is_global
from .._core.tree import keystr, tree_flatten_with_path

__all__ = [
    "Done",
    "Failed",
    "Health",
    "Message",
    "Ready",
    "RemoteTraceback",
    "SpawnError",
    "Task",
    "check_result",
    "failure",
    "ranks_text",
    "send",
]


class SpawnError(RuntimeError):
    """A rank died without returning (an exit or a signal), ranks waited for each other in
    collectives that cannot complete, or a rank's exception could not be sent back as itself;
    the message names the ranks and the cause carries the remote tracebacks."""


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker process.

    Attached as ``__cause__`` of the exception re-raised in the caller, so that the caller's
    traceback shows where in the worker the error happened.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Health:
    """What a caller needs to know to keep reusing a worker: whether the default group still
    exists, how many groups were created, and where debug mode's counters stand (ranks must
    agree on both, or later collectives, or checks, mismatch)."""

    initialized: bool
    groups: int
    sequence: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Task:
    """``fn(*args, **kwargs)``, run on every rank."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Ready:
    """The worker (process ``pid``) has joined the process group."""

    pid: int
    health: Health


@dataclass(frozen=True)
class Done:
    """The task returned ``value``."""

    value: Any
    health: Health


@dataclass(frozen=True)
class Failed:
    """The task (or joining the group) raised: the pickled exception when it survives a
    pickle round trip (else ``None``), its qualified type name, text and formatted traceback."""

    payload: bytes | None
    kind: str
    text: str
    traceback: str
    health: Health

    @property
    def name(self) -> str:
        """The exception's type name without its module."""
        return self.kind.rsplit(".", 1)[-1]


Message = Ready | Done | Failed


def failure(exc: BaseException, health: Health, note: str | None = None) -> Failed:
    """The :class:`Failed` message describing ``exc`` (with ``note`` added to it)."""
    if note is not None and hasattr(exc, "add_note"):
        exc.add_note(note)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    payload: bytes | None
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return Failed(payload, kind, str(exc), text, health)


def send(conn: multiprocessing.connection.Connection, message: Message) -> None:
    conn.send_bytes(pickle.dumps(message))


def ranks_text(ranks: Iterable[int]) -> str:
    """``"rank 1"``, ``"ranks 0, 2"``."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def check_result(value: Any, caller: str, rank: int, nprocs: int) -> None:
    """Refuse a rank's result that holds a :class:`~pshard.GlobalTensor`: its mesh's process
    groups end with the run, so the caller could not use it.

    Raises:
        TypeError: naming the path of the first one and what to return instead.
    """
    paths, leaves, _ = tree_flatten_with_path(value, none_is_leaf=True)
    for path, leaf in zip(paths, leaves, strict=True):
        if is_global(leaf):
            where = keystr(path, "result")
            raise TypeError(
                f"{caller}: rank {rank} of {nprocs} returned a GlobalTensor at {where}, whose "
                f"mesh and process groups end with the run (the caller could not use it); "
                f"return ps.gather(x) for the whole value, or x.local for this rank's block "
                f"(with x.spec and x.shape for its layout)"
            )

"""The ranks' exchanges during a save: object collectives on one process group, or none.

A save exchanges a few Python objects (DCP's plans and write results, each rank's account of
the tree): :class:`GroupComm` does it over a process group (the default one, for a blocking
save and for the call of an async save), :class:`StoreComm` through a file store beside the
checkpoint (the background thread of an async save: no process group, so it finishes also
after the caller destroyed its groups, and the caller's collectives go on meanwhile),
:class:`LocalComm` for a process without a process group.

:func:`agree` runs one step on every rank and makes a failure anywhere a failure everywhere: a
rank that raised raises its own exception, the others a :class:`RuntimeError` naming it, so
no rank waits for a partner that gave up and every rank leaves the save the same way (a
``ValueError`` or ``TypeError``, a mistake in the call, is raised on every rank with its
message, which ends with the ranks that found it, ``(on rank 1 of 2)``, unless every rank did).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

__all__ = ["Comm", "GroupComm", "LocalComm", "StoreComm", "agree", "default_comm"]

T = TypeVar("T")
R = TypeVar("R")


class Comm(Protocol):
    """Object exchanges among the ranks of a save; rank 0 coordinates."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
        ...

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank 0's ``objs[r]`` on rank ``r``."""
        ...


class GroupComm:
    """:class:`Comm` over a process group (``None``: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs, group=self.group, group_src=0)
        return out[0]


class StoreComm:
    """:class:`Comm` through a key-value store the ranks share and no process group
    (:func:`pshard._runtime.threads.exchange_store`: a file store beside the checkpoint, or
    in-process ranks' own), so a background save goes on after the caller destroyed its
    groups. A file store's file is removed once every rank's store is closed
    (:meth:`close`)."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self._store: dist.Store | None = store
        self.rank, self.size = rank, size
        self._step = 0

    def _store_open(self) -> dist.Store:
        if self._store is None:
            raise RuntimeError("the save's store is closed")
        return self._store

    def gather(self, obj: Any) -> list[Any] | None:
        store, step = self._store_open(), self._step
        _put(store, f"gather/{step}/{self.rank}", obj)
        if self.rank != 0:
            return None
        return [pickle.loads(store.get(f"gather/{step}/{r}")) for r in range(self.size)]

    def scatter(self, objs: list[Any] | None) -> Any:
        store, step = self._store_open(), self._step
        self._step += 1
        if self.rank == 0:
            assert objs is not None
            for r, obj in enumerate(objs):
                _put(store, f"scatter/{step}/{r}", obj)
        return pickle.loads(store.get(f"scatter/{step}/{self.rank}"))

    def close(self) -> None:
        self._store = None  # the last rank's store to close removes the file


def _put(store: dist.Store, key: str, obj: Any) -> None:
    value: Any = pickle.dumps(obj)  # the store takes bytes (its stubs say str)
    store.set(key, value)


class LocalComm:
    """:class:`Comm` of a process alone (no process group)."""

    rank = 0
    size = 1

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None
        return objs[0]


def default_comm() -> Comm:
    """The default process group's :class:`GroupComm`, or :class:`LocalComm` without one."""
    if dist.is_available() and dist.is_initialized():
        return GroupComm(None)
    return LocalComm()


@dataclasses.dataclass(frozen=True)
class _Failed:
    rank: int
    user_error: bool  # a ValueError or TypeError: the same mistake on every rank
    kind: str
    text: str
    raised: str = ""  # the message as raised, where ``text`` adds the ranks that raised it


def _failed(rank: int, e: Exception) -> _Failed:
    user = type(e) in (ValueError, TypeError)
    return _Failed(rank, user, type(e).__name__, str(e))


def _failure(outcomes: list[Any]) -> _Failed | None:
    """The first rank's failure; a mistake found on some ranks only names them."""
    failed = next((o for o in outcomes if isinstance(o, _Failed)), None)
    if failed is None or not failed.user_error:
        return failed
    ranks: list[int] = []
    others: list[int] = []
    for r, o in enumerate(outcomes):
        if isinstance(o, _Failed):
            same = (o.kind, o.text) == (failed.kind, failed.text)
            (ranks if same else others).append(r)
    if len(ranks) == len(outcomes):
        return failed
    text = f"{failed.text} (on {_ranks(ranks)} of {len(outcomes)}"
    text += f"; {_ranks(others)} raised another)" if others else ")"
    return dataclasses.replace(failed, text=text, raised=failed.text)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _raise(failed: _Failed, mine: BaseException | None, what: str) -> None:
    if mine is not None:
        if failed.raised and (type(mine).__name__, str(mine)) == (failed.kind, failed.raised):
            mine.args = (failed.text,)  # this rank's own mistake, with the ranks that made it
        raise mine
    if failed.user_error:
        raise (ValueError if failed.kind == "ValueError" else TypeError)(failed.text)
    raise RuntimeError(
        f"{what}: rank {failed.rank} failed ({failed.kind}: {failed.text}); nothing was switched"
    )


def agree(
    comm: Comm,
    what: str,
    local: Callable[[], T],
    central: Callable[[list[T]], list[R]],
) -> R:
    """One step of a save on every rank: ``local()`` on each, ``central`` on rank 0 over
    every rank's result (one value back per rank), each rank's value returned.

    Raises:
        BaseException: the exception ``local`` or ``central`` raised on this rank.
        ValueError, TypeError: another rank's step raised it (a mistake in the call: every
            rank raises it, with its message and, unless every rank raised it, the ranks that
            did).
        RuntimeError: another rank's step failed otherwise (its message is named).
    """
    mine: BaseException | None = None
    try:
        outcome: Any = local()
    except Exception as e:
        mine, outcome = e, _failed(comm.rank, e)
    gathered = comm.gather(outcome)
    back: list[Any] | None = None
    if gathered is not None:
        failed = _failure(gathered)
        if failed is None:
            try:
                back = list(central(gathered))
            except Exception as e:
                mine, failed = e, _failed(comm.rank, e)
        back = back if failed is None else [failed] * comm.size
    answer = comm.scatter(back)
    if isinstance(answer, _Failed):
        _raise(answer, mine, what)
    out: R = answer
    return out

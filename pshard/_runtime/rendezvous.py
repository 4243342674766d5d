"""What the in-process ranks of one world share: the store, the groups, the work in flight.

:class:`Shared` holds the world's state (the store's keys; per process group, the collectives
each rank has posted and the sends and receives waiting for their partner), which only the task
holding the turn touches (:mod:`pshard._runtime.turns`); :class:`ThreadStore` is the world's
key-value store and :class:`ThreadWork` a c10d ``Work`` whose ``wait`` gives the turn away until
the operation is done. The process group itself is :mod:`pshard._runtime.transport`'s.
"""

from __future__ import annotations

import collections
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from .turns import Turns

__all__ = ["GroupState", "Message", "Shared", "Slot", "ThreadStore", "ThreadWork"]


@dataclass
class Slot:
    """One collective on a group: each rank's part as it arrives, then done (or an error)."""

    op: str
    parts: dict[int, Any] = field(default_factory=dict)
    calls: dict[int, str] = field(default_factory=dict)
    done: bool = False
    error: BaseException | None = None


@dataclass
class Message:
    tensor: torch.Tensor
    done: bool = False
    error: BaseException | None = None


@dataclass
class GroupState:
    """What the ranks of one group share: their collectives in flight and their mailboxes."""

    name: str
    members: tuple[int, ...]  # global ranks, by group rank
    issued: list[int]  # collectives issued so far, per group rank
    slots: dict[int, Slot] = field(default_factory=dict)
    sends: dict[tuple[int, int, int], collections.deque[Message]] = field(default_factory=dict)
    recvs: dict[tuple[int, int, int], collections.deque[Message]] = field(default_factory=dict)


class Shared:
    """What the ranks of one in-process world share: the turns, the store, the groups."""

    def __init__(self, size: int, turns: Turns) -> None:
        self.size = size
        self.turns = turns
        self.keys: dict[str, bytes] = {}
        self.groups: dict[tuple[str, int], GroupState] = {}
        self.made: dict[tuple[int, str], int] = {}  # (global rank, name) -> groups made
        self.store: ThreadStore | None = None  # the world's store, set by the world's runner

    def group(self, name: str, members: tuple[int, ...], me: int) -> GroupState:
        """Group ``name`` as rank ``me`` (global) makes it: its ``n``-th group of that name
        meets the others' ``n``-th (names come back after a group is destroyed)."""
        n = self.made.get((me, name), 0)
        self.made[(me, name)] = n + 1
        key = (name, n)
        state = self.groups.get(key)
        if state is None:
            state = self.groups[key] = GroupState(name, members, [0] * len(members))
        elif state.members != members:
            raise ValueError(
                f"in-process ranks: rank {me} made process group {name!r} of ranks {members}, "
                f"another rank made it of ranks {state.members}"
            )
        return state


class ThreadWork(dist.Work):
    """An operation in flight: :meth:`wait` gives the turn away until it is done."""

    def __init__(
        self,
        turns: Turns,
        done: Callable[[], bool],
        error: Callable[[], BaseException | None],
        what: str,
        result: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self._turns = turns
        self._done = done
        self._error = error
        self._what = what
        self._result = result or []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._turns.block(self._done, self._what)
        error = self._error()
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        return self._done()

    def is_success(self) -> bool:
        return self._done() and self._error() is None

    def exception(self) -> BaseException | None:
        return self._error()

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        pass

    def get_future(self) -> Future:
        self.wait()
        future: Future = Future()
        future.set_result(self._result)
        return future


class ThreadStore(dist.Store):
    """The world's key-value store; a wait for a key gives the turn away."""

    def __init__(self, shared: Shared) -> None:
        super().__init__()
        self._shared = shared

    def _keys(self) -> dict[str, bytes]:
        return self._shared.keys

    def set(self, key: str, value: str | bytes) -> None:
        self._keys()[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._keys()[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self._keys().get(key, b"0")) + amount
        self._keys()[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        keys = self._keys()
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        if key not in keys:
            if exp:
                return exp
            keys[key] = new
        elif keys[key] == exp:
            keys[key] = new
        return keys[key]

    def append(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._keys()[key] = self._keys().get(key, b"") + data

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def check(self, keys: list[str]) -> bool:
        return all(k in self._keys() for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._shared.turns.block(lambda: self.check(keys), f"a wait for store keys {keys}")

    def delete_key(self, key: str) -> bool:
        return self._keys().pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._keys())

    def has_extended_api(self) -> bool:
        return True

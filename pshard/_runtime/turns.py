"""Turn-taking for in-process ranks: the threads of one in-process world run one at a time.

The ranks of ``ps.spawn(..., backend="threads")`` are threads of one process, and much of what a
process owns is one object per process here: torch's default random generator, the default
dtype. So the ranks take turns: exactly one task (a rank's main thread, or a thread a rank
started through :func:`start_thread`) runs at a time, and it gives the turn away only while it
waits (:meth:`Turns.block`: for a collective, a receive, a key of the store). At every hand-over
between ranks the leaving rank's random state, default dtype and writes into objects the ranks
share (:mod:`pshard._runtime.rank_local`) are put aside and the entering rank's restored, so
each rank draws as a fresh process would, and the next task is chosen by a fixed rule (the
first that can run, in order after the one leaving), so a run is the same from one time to the
next.

A hang is seen exactly: when the task leaving is blocked and no task can run, every blocked
task is woken with a :class:`Stuck` error naming what each waits for, and what the ranks that
ended did (returned, raised). Nothing waits for a timer.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import ctypes
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import ad_state, set_ad_state

__all__ = [
    "RANK_THREAD",
    "Rank",
    "Stuck",
    "Task",
    "Turns",
    "current_task",
    "in_background",
    "start_thread",
]

RANK_THREAD = "pshard-rank"
"""The name of an in-process rank's thread, followed by its index."""


class Stuck(RuntimeError):
    """Raised in a task whose wait can never end (the ranks it waits for are blocked too, or
    have ended), or in every task when the caller gives up (its timeout)."""


@dataclass
class Rank:
    """What a rank owns that a process would: its random state and default dtype while another
    rank runs, and debug mode's counters."""

    index: int
    size: int
    rng: torch.Tensor = field(default_factory=lambda: _fresh_rng())
    dtype: torch.dtype = torch.float32
    # forward-mode AD's and make_fx's process globals, as this rank sees them
    ad: tuple[Any, ...] = (0, -1, None, False)
    debug_sequence: dict[str, int] = field(default_factory=dict)
    ended: str = ""  # "returned", "raised <type>", ... once its main task is done
    shared: Any = None  # the transport's state shared by the world's ranks
    c10d: Any = None  # its c10d world (process groups, their names)
    local: list[Any] = field(default_factory=list)  # its writes into shared objects (rank_local)


def _fresh_rng() -> torch.Tensor:
    """The random state of a fresh process: seeded from the system's entropy."""
    generator = torch.Generator()
    generator.seed()
    return generator.get_state()


class Task:
    """One thread under the turns: a rank's main thread or one it started."""

    def __init__(self, turns: Turns, rank: Rank, name: str, main: bool) -> None:
        self.turns = turns
        self.parent: Task | None = None
        self.rank = rank
        self.name = name
        self.main = main
        self.state = "ready"  # ready | blocked | done
        self.until: Callable[[], bool] | None = None
        self.what = ""
        self.error: BaseException | None = None  # raised in the task when it wakes
        self.thread_id: int | None = None
        self.cond = threading.Condition(turns.lock)

    def __repr__(self) -> str:
        return f"Task({self.name}, {self.state})"


_TASK: contextvars.ContextVar[Task | None] = contextvars.ContextVar("pshard_task", default=None)


def current_task() -> Task | None:
    """The task running in this context, ``None`` outside in-process ranks."""
    return _TASK.get()


class Turns:
    """The turn shared by the tasks of one in-process world (see the module docs)."""

    def __init__(self, ranks: list[Rank], caller: str) -> None:
        self.lock = threading.Lock()
        self.ranks = ranks
        self.caller = caller
        self.tasks: list[Task] = []
        self.current: Task | None = None
        self.finished = threading.Condition(self.lock)
        self.abort: BaseException | None = None  # set when the caller gives up

    # -- tasks

    def add(self, rank: Rank, name: str, main: bool) -> Task:
        with self.lock:
            task = Task(self, rank, name, main)
            self.tasks.append(task)
            return task

    def enter(self, task: Task) -> None:
        """Called first in the task's thread: wait for the first turn."""
        task.thread_id = threading.get_ident()
        _TASK.set(task)
        with self.lock:
            if self.current is None and self.abort is None:
                self.current = task
            while self.current is not task:
                task.cond.wait()
        self._arrive(task)
        self._raise_pending(task)

    def leave(self, task: Task, ended: str = "") -> None:
        """The task is done: pass the turn on for good."""
        with self.lock:
            task.state = "done"
            if task.main:
                task.rank.ended = ended
            self._depart(task)
            self._pass(task)
            self.finished.notify_all()

    def block(self, until: Callable[[], bool], what: str) -> None:
        """Wait until ``until()`` (read under the turn) is true, giving the turn away.

        Raises:
            Stuck: it can never become true.
        """
        task = _TASK.get()
        if task is None or task.turns is not self:
            raise RuntimeError(
                f"{self.caller}: a thread that is not one of its ranks used their process group "
                f"({what}); start threads in a rank with pshard's start_thread, or communicate "
                f"from the rank's own thread"
            )
        if until():
            return
        with self.lock:
            task.state, task.until, task.what = "blocked", until, what
            self._depart(task)
            self._pass(task)
            while self.current is not task:
                task.cond.wait()
            task.state, task.until, task.what = "ready", None, ""
        self._arrive(task)
        self._raise_pending(task)

    def all_done(self) -> bool:
        return all(t.state == "done" for t in self.tasks)

    def children_done(self, task: Task) -> bool:
        """Whether every thread ``task``'s rank started has ended."""
        return all(t.state == "done" for t in self.tasks if t.rank is task.rank and not t.main)

    def wait_all(self, timeout: float | None) -> bool:
        """Caller side: wait until every task is done (``False`` at the timeout)."""
        with self.lock:
            return self.finished.wait_for(self.all_done, timeout)

    def give_up(self, error: BaseException) -> None:
        """Caller side: end the run. Blocked tasks wake with ``error``; the running one gets it
        raised asynchronously at its next Python instruction."""
        with self.lock:
            self.abort = error
            running = self.current
            for task in self.tasks:
                if task.state == "blocked":
                    task.state = "ready"
            if running is not None and running.thread_id is not None:
                _async_raise(running.thread_id, type(error))
            if running is None or running.state == "done":
                self.current = None
                self._pass(None)

    # -- hand-over (the leaving task holds the turn; every state change happens under it)

    def _depart(self, task: Task) -> None:
        """Put the rank's process state aside (called holding the turn, before passing it)."""
        task.rank.rng = torch.get_rng_state()
        task.rank.dtype = torch.get_default_dtype()
        task.rank.ad = ad_state()
        for held in reversed(task.rank.local):  # the objects the ranks share as they were
            held.aside()

    def _arrive(self, task: Task) -> None:
        torch.set_rng_state(task.rank.rng)
        torch.set_default_dtype(task.rank.dtype)
        set_ad_state(task.rank.ad)
        for held in task.rank.local:
            held.back()

    def _raise_pending(self, task: Task) -> None:
        error, task.error = task.error, None
        if error is None:
            error = self.abort
        if error is not None:
            raise error

    def _pass(self, leaving: Task | None) -> None:
        """Give the turn to the next task that can run, in order after ``leaving``; release
        everyone when none can (with the lock held)."""
        n = len(self.tasks)
        start = 0 if leaving is None else self.tasks.index(leaving) + 1
        order = [self.tasks[(start + i) % n] for i in range(n)]
        for task in order:
            if task.state == "ready" or (task.state == "blocked" and self._can_go(task)):
                return self._give(task)
        blocked = [t for t in order if t.state == "blocked"]
        if not blocked:
            self.current = None
            return None
        error = self.abort or Stuck(self._stuck_text(blocked))
        for task in blocked:
            task.error = error
            task.state = "ready"
        return self._give(blocked[0])

    def _can_go(self, task: Task) -> bool:
        assert task.until is not None
        try:
            return task.until()
        except BaseException as exc:  # an error of the wait itself: raised in the task
            task.error = exc
            return True

    def _give(self, task: Task) -> None:
        self.current = task
        task.cond.notify()

    def _stuck_text(self, blocked: list[Task]) -> str:
        frames = sys._current_frames()
        lines = []
        for task in sorted(blocked, key=lambda t: (t.rank.index, not t.main)):
            where = _user_line(frames.get(task.thread_id or -1))
            who = f"rank {task.rank.index}" + ("" if task.main else f" ({task.name})")
            lines.append(f"  {who} waits in {task.what}{where}")
        for rank in self.ranks:
            if rank.ended:
                lines.append(f"  rank {rank.index} {rank.ended}")
        return (
            f"{self.caller}: the ranks wait for each other in collectives that cannot complete:\n"
            + "\n".join(lines)
            + "\nEvery rank of a group must call the same collectives in the same order "
            "(PSHARD_DEBUG=1 names mismatched calls)"
        )


def _user_line(frame: Any) -> str:
    """`` (called at file:line)``: the innermost frame outside torch and pshard."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in ("/torch/", "/pshard/", "threading.py")):
            return f" (called at {path}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def _async_raise(thread_id: int, kind: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(kind))


def start_thread(
    target: Callable[[], None], *, name: str, daemon: bool = False
) -> threading.Thread:
    """Start ``target`` in a new thread; inside an in-process rank it is a task of that rank
    (it takes turns with the ranks, and the run waits for it as a process waits for its
    non-daemon threads), elsewhere a plain thread."""
    task = _TASK.get()
    if task is None:
        thread = threading.Thread(target=target, name=name, daemon=daemon)
        thread.start()
        return thread
    turns = task.turns
    child = turns.add(task.rank, name, main=False)
    child.parent = task
    context = contextvars.copy_context()

    def run() -> None:
        turns.enter(child)
        try:
            target()
        finally:
            turns.leave(child)

    thread = threading.Thread(target=context.run, args=(run,), name=name, daemon=True)
    thread.start()
    return thread


class _TurnFuture(concurrent.futures.Future):
    """A future whose waits give the turn away in an in-process rank (the thread that sets it
    is a task of that rank, which needs the turn to run)."""

    def _await(self, timeout: float | None) -> None:
        task = _TASK.get()
        if task is not None and not self.done():
            task.turns.block(self.done, "the result of its own background thread")

    def result(self, timeout: float | None = None) -> Any:
        self._await(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._await(timeout)
        return super().exception(timeout)


def in_background(job: Callable[[], None], *, name: str) -> concurrent.futures.Future[None]:
    """Run ``job`` in a thread (:func:`start_thread`); its future, set when it ends (waiting
    on it in an in-process rank gives the turn to the thread)."""
    future: concurrent.futures.Future[None] = _TurnFuture()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            job()
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)

    start_thread(run, name=name)
    return future

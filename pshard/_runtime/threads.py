"""In-process ranks: ``ps.spawn(fn, ..., backend="threads")``.

:func:`run_threads` runs ``fn`` on ``nprocs`` threads of the calling process, each a rank of a
c10d world of its own (:mod:`pshard._compat`'s world switch: ``torch.distributed.get_rank()``
in a rank thread is that rank, and the caller's own process group, if any, is untouched) over
the in-process transport (:mod:`pshard._runtime.transport`). The ranks take turns
(:mod:`pshard._runtime.turns`): each has the random state and default dtype of a fresh process,
and a run gives the same numbers every time.

Nothing is pickled or copied: every rank gets the very argument objects, and the caller each
rank's own result. An exception in a rank is re-raised in the caller as itself, with a note
naming the rank; ranks left waiting for it are released at once (no rank can run and not all
are done: :class:`~pshard._runtime.turns.Stuck`), so a run never hangs on a failed rank, and no
thread is left running.
"""

from __future__ import annotations

import contextvars
import datetime
import linecache
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._compat import (
    THREADS_BACKEND,
    ad_state,
    install_world_switch,
    new_c10d_world,
    register_backend,
    route_reparametrization,
    set_ad_state,
    share_dual_level,
    thread_isolation,
)
from .messages import SpawnError, check_result, ranks_text
from .rank_local import hold_reparametrization
from .rendezvous import Shared, ThreadStore
from .transport import ThreadGroup
from .turns import RANK_THREAD, Rank, Stuck, Task, Turns, current_task

__all__ = ["current_rank", "exchange_store", "run_threads"]

# Seconds the ranks get to end after the caller gave up (its timeout), before it reports them
# (a rank in Python stops at its next instruction; one in C code cannot be stopped), and the
# bound on the wait for threads once the run is over.
_STOP_WAIT_S = 1.0
_END_WAIT_S = 5.0


def current_rank() -> Rank | None:
    """The in-process rank this code runs in, ``None`` in a process of its own."""
    task = current_task()
    return None if task is None else task.rank


def exchange_store(file: str, name: str) -> dist.Store:
    """A key-value store the ranks share that needs no process group (it outlives them): for
    processes a ``FileStore`` at ``file`` (every rank opens it; the last to let go removes it),
    for in-process ranks their world's own store under the prefix ``name`` (a wait in it gives
    the turn away, where a file store's would hold it)."""
    task = current_task()
    if task is not None:
        return dist.PrefixStore(name, task.rank.shared.store)
    store = dist.FileStore(file, dist.get_world_size() if dist.is_initialized() else 1)
    store.set_timeout(datetime.timedelta(minutes=30))
    return store


def _rank_world() -> Any:
    task = current_task()
    return None if task is None else task.rank.c10d


def _create(options: Any, backend_options: Any) -> ThreadGroup:
    """c10d's constructor for a group of the in-process backend (called in a rank's thread)."""
    task = current_task()
    if task is None or not isinstance(task.rank.shared, Shared):
        raise RuntimeError(
            f"the {THREADS_BACKEND!r} process-group backend runs only in the ranks of "
            f"ps.spawn(..., backend='threads')"
        )
    shared: Shared = task.rank.shared
    members = tuple(options.global_ranks_in_group) or tuple(range(shared.size))
    state = shared.group(str(options.group_id), members, task.rank.index)
    return ThreadGroup(shared, state, int(options.group_rank))


class _Isolation:
    """The C++ group registry is per thread while any in-process world runs."""

    lock = threading.Lock()
    worlds = 0

    def __enter__(self) -> None:
        with self.lock:
            if _Isolation.worlds == 0:
                thread_isolation(True)
            _Isolation.worlds += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            _Isolation.worlds -= 1
            if _Isolation.worlds == 0:
                thread_isolation(False)


def run_threads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nprocs: int,
    timeout: float,
    caller: str,
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``nprocs`` in-process ranks; their results in rank order.

    Raises:
        BaseException: the exception of the lowest rank that raised one (as itself, with a
            note naming the rank), else :class:`SpawnError` (ranks waiting for each other for
            good, ``sys.exit`` in a rank), or ``TimeoutError`` after ``timeout`` seconds.
    """
    install_world_switch(_rank_world)
    route_reparametrization(hold_reparametrization)
    share_dual_level(lambda: current_task() is not None)
    register_backend(THREADS_BACKEND, _create)
    ranks = [Rank(r, nprocs) for r in range(nprocs)]
    turns = Turns(ranks, f"{caller} (backend='threads')")
    shared = Shared(nprocs, turns)
    store = shared.store = ThreadStore(shared)  # kept alive by the world (C++ holds no Python ref)
    results: list[Any] = [None] * nprocs
    errors: dict[int, BaseException] = {}
    tasks = []
    for rank in ranks:
        rank.shared, rank.c10d = shared, new_c10d_world()
        tasks.append(turns.add(rank, f"rank {rank.index}", main=True))

    def body(r: int) -> None:
        task = tasks[r]
        ended = "returned"
        try:
            turns.enter(task)
            try:
                dist.init_process_group(THREADS_BACKEND, store=store, rank=r, world_size=nprocs)
                results[r] = fn(*args, **kwargs)
                check_result(results[r], caller, r, nprocs)
            finally:
                # as a process ends once its own threads have (an async save, say)
                turns.block(lambda: turns.children_done(task), "its own threads")
                # (a rank the caller gave up on, back from where it was stuck, touches c10d no
                # more: the run may be over, its groups no longer the thread's own)
                if dist.is_initialized() and turns.abort is None:
                    dist.destroy_process_group()
        except SystemExit as exc:
            errors[r] = SpawnError(
                f"{caller}: fn called sys.exit({exc.code!r}) in rank {r} of {nprocs}; return "
                f"from fn instead (a rank that exits leaves its peers waiting in collectives)"
            )
            ended = "called sys.exit"
        except BaseException as exc:
            errors[r] = exc
            ended = f"raised {type(exc).__name__}"
        finally:
            turns.leave(task, ended)

    rng, dtype, ad = torch.get_rng_state(), torch.get_default_dtype(), ad_state()
    hook = sys.excepthook  # each rank's init_process_group wraps it with a "[rankN]:" prefix
    threads = [
        threading.Thread(
            target=contextvars.Context().run, args=(body, r), name=f"{RANK_THREAD}{r}", daemon=True
        )
        for r in range(nprocs)
    ]
    deadline = time.monotonic() + timeout
    late: TimeoutError | None = None
    try:
        with _Isolation():
            turns.current = tasks[0]
            for thread in threads:
                thread.start()
            end = deadline + _END_WAIT_S  # the last moment to wait for the threads
            if not turns.wait_all(timeout):
                running = [t.rank.index for t in turns.tasks if t.state != "done"]
                late = TimeoutError(
                    f"{caller}: {ranks_text(sorted(set(running)))} of {nprocs} still running "
                    f"after the timeout of {timeout:g} s; they were stopped"
                )
                stuck = turns.current  # the task that holds the turn (maybe where Python
                where = _where(stuck)  # cannot stop it: a sleep, a blocking read)
                turns.give_up(late)
                end = time.monotonic() + _STOP_WAIT_S
                if not turns.wait_all(_STOP_WAIT_S) and stuck is not None:
                    late = TimeoutError(
                        f"{caller}: rank {stuck.rank.index} of {nprocs} is stuck{where} after "
                        f"the timeout of {timeout:g} s, outside Python where it cannot be "
                        f"stopped (its thread is a daemon and is left to end on its own; it "
                        f"never holds the interpreter's exit)"
                    )
            for thread in threads:
                thread.join(max(0.0, end - time.monotonic()))
    finally:
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        set_ad_state(ad)
        sys.excepthook = hook
    if late is not None:
        raise late
    left = [t.name for t in threads if t.is_alive()]
    if left:
        raise SpawnError(
            f"{caller}: the threads of {', '.join(left)} are still running after the run ended "
            f"(stuck outside Python, where they cannot be stopped)"
        )
    if errors:
        raise _failure(errors, nprocs, caller)
    return results


def _failure(errors: dict[int, BaseException], nprocs: int, caller: str) -> BaseException:
    """The exception for a failed run: the lowest rank's own error, else what left the ranks
    stuck."""
    own = {r: e for r, e in errors.items() if not isinstance(e, Stuck)}
    if own:
        rank = min(own)
        exc = own[rank]
        notes = [f"rank {r} also raised {type(e).__name__}" for r, e in own.items() if r != rank]
        released = sorted(r for r, e in errors.items() if isinstance(e, Stuck))
        if released:
            verb = "was" if len(released) == 1 else "were"
            notes.append(f"{ranks_text(released)} {verb} waiting for it and {verb} released")
        _add_note(
            exc,
            f"{caller}: raised in rank {rank} of {nprocs} (threads)"
            + "".join(f"; {n}" for n in notes),
        )
        return exc
    rank = min(errors)
    error = SpawnError(str(errors[rank]))
    error.__cause__ = errors[rank]
    return error


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11 and later
        exc.add_note(note)


def _where(task: Task | None) -> str:
    """`` in fn at file.py:12 (`time.sleep(12)`)``: the innermost frame of ``task``'s thread."""
    if task is None or task.thread_id is None:
        return ""
    frame = sys._current_frames().get(task.thread_id)
    if frame is None:
        return ""
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f" in {code.co_name} at {code.co_filename}:{frame.f_lineno}" + (
        f" ({line})" if line else ""
    )

"""Running a function on several local processes that share a process group.

:func:`spawn` starts fresh processes (the multiprocessing ``"spawn"`` start method), gives each a
default process group of the requested size, runs the function and gathers the per-rank results.
The machinery underneath is :class:`_Gang`: a set of persistent worker processes that rendezvous
once on a store hosted by the calling process (bound to 127.0.0.1 only) and then run any number
of calls. ``spawn`` uses a gang for a single call; a test harness can keep one alive across calls.

Failures are never silent and never leave processes behind: an exception in a rank is re-raised
in the caller with the rank and the remote traceback; a rank that dies, a rank still running a
short grace period after another one failed (typically blocked in a collective waiting for it),
and every rank still running at the deadline are terminated, then killed, then reaped.
"""

from __future__ import annotations

import ast
import datetime
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["spawn", "SpawnError", "RemoteTraceback"]

# Seconds the other ranks get to finish once one rank has failed, before they are torn down.
_GRACE_S = 1.0
# Seconds a rank gets to exit after SIGTERM before SIGKILL.
_TERM_WAIT_S = 2.0
# How often a worker checks that its caller is still alive.
_WATCH_S = 0.2
# Once a rank has returned, how often the others are asked where they are, and how long one
# may wait in the same collective before that is an error (its peer has returned).
_PROBE_S = 1.0
_STUCK_S = 3.0


class SpawnError(RuntimeError):
    """A rank died without returning (an exit or a signal), or its exception could not be sent
    back as itself; the message names the rank and the cause carries the remote traceback."""


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


# ----------------------------------------------------------------------------- worker side


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _health() -> tuple[bool, int, Any]:
    """What a caller needs to know to keep reusing a worker: whether the default group still
    exists, how many groups were created and where debug mode's counters stand (ranks must
    agree on both, or later collectives, or checks, mismatch)."""
    from .debug import sequence_state

    world = getattr(dist.distributed_c10d, "_world", None)
    return dist.is_initialized(), int(getattr(world, "group_count", 0)), sequence_state()


def _failure(exc: BaseException, note: str | None = None) -> tuple:
    """The message describing ``exc``: the pickled exception when it survives a pickle round
    trip (so the caller can re-raise it as itself), its type, text and formatted traceback."""
    if note is not None and hasattr(exc, "add_note"):
        exc.add_note(note)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload: bytes | None = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:
        payload = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return ("err", (payload, kind, str(exc), text), _health())


def _send(conn: multiprocessing.connection.Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message))


def _watch_caller(caller: int, control: Any) -> None:
    """End this worker within a fraction of a second of its caller's death (SIGKILL included),
    so that no rank outlives the process that spawned it: the caller is gone when this
    process's parent changes (it is re-parented). The same thread answers the caller's
    ``"where"``: what the main thread is doing (see :func:`_where`)."""
    main = threading.main_thread().ident

    def watch() -> None:
        while os.getppid() == caller:
            try:
                if control.poll(_WATCH_S) and control.recv() == "where":
                    control.send(_where(main))
            except (EOFError, OSError):
                time.sleep(_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="pshard-caller-watch", daemon=True).start()


# frames of these files mean "waiting in a collective" (a torch.distributed call, or pshard's
# raw communication); debug mode's checks wait on the store with a timeout and an error of
# their own, so they are not counted
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

_COLLECTIVE_FILES = (
    os.path.join("torch", "distributed", "distributed_c10d.py"),
    os.path.join("pshard", "_runtime", "wire.py"),
)


def _where(thread: int | None) -> tuple[bool, str]:
    """Whether ``thread`` is inside a collective, and where: the collective's function and the
    innermost frame of the program around it."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    stack = traceback.extract_stack(frame) if frame is not None else []
    inside = [f for f in stack if f.filename.endswith(_COLLECTIVE_FILES)]
    if not inside:
        return False, ""
    first = stack.index(inside[0])

    def library(f: traceback.FrameSummary) -> bool:
        return "torch" in f.filename.split(os.sep) or f.filename.startswith(_PACKAGE_DIR)

    caller = next((f for f in reversed(stack[:first]) if not library(f)), inside[0])
    return True, (
        f"{inside[-1].name} in {os.path.basename(inside[-1].filename)}, called from "
        f"{caller.name} ({caller.filename}:{caller.lineno})"
    )


def _worker_main(
    rank: int,
    nprocs: int,
    backend: str,
    port: int,
    conn: multiprocessing.connection.Connection,
    pg_timeout_s: float,
    control: multiprocessing.connection.Connection | None = None,
) -> None:
    """Body of one worker: join the process group, then run calls until told to stop.

    Protocol (pickled tuples over ``conn``): the worker first sends ``("ready", pid, health)``
    or ``("err", ...)``; then for every task ``(fn, args, kwargs)`` it answers
    ``("ok", value, health)`` or ``("err", ...)``; ``None`` (or the caller going away) stops it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and tears down
    _watch_caller(os.getppid(), control)
    if "OMP_NUM_THREADS" not in os.environ:
        # Every rank shares this machine's cores: one full-width thread pool per rank
        # oversubscribes them, which slows gloo down by an order of magnitude.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    lo = _loopback_interface()
    if lo is not None and backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    try:
        try:
            timeout = datetime.timedelta(seconds=pg_timeout_s)
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=nprocs, timeout=timeout
            )
        except BaseException as exc:
            _send(conn, _failure(exc, "while joining the process group"))
            return
        _send(conn, ("ready", os.getpid(), _health()))
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the caller is gone
                return
            try:
                task = pickle.loads(data)
                if task is None:
                    return
                fn, args, kwargs = task
                value = fn(*args, **kwargs)
            except SystemExit as exc:  # re-raised in the caller it would end the caller quietly
                error = SpawnError(
                    f"fn called sys.exit({exc.code!r}) in rank {rank} of {nprocs}; return from "
                    f"fn instead (a rank that exits leaves its peers waiting in collectives)"
                )
                _send(conn, _failure(error))
                continue
            except BaseException as exc:
                _send(conn, _failure(exc))
                continue
            try:
                message = pickle.dumps(("ok", value, _health()))
            except BaseException as exc:
                _send(conn, _failure(exc, "while pickling the return value to send it back"))
                continue
            conn.send_bytes(message)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
        # The interpreter's last garbage collections over torch's object graph take seconds
        # when several workers exit at once; exiting needs none of them.
        gc.freeze()


# ----------------------------------------------------------------------------- caller side


def _check_fn(fn: Any, caller: str) -> None:
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"{caller}: fn {qualname!r} is a lambda or a function defined inside another "
            "function, which cannot be pickled into the worker processes; define it at the top "
            "level of a module (functions are pickled by module and name)"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{caller}: fn {fn!r} cannot be pickled into the worker processes ({exc}); pass a "
            "function defined at the top level of an importable module"
        ) from exc
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"{caller}: fn {qualname!r} is defined in `python -c`, an interactive session or a "
            f"notebook, where the worker processes cannot import it from (they start fresh and "
            f"import fn by module and name); put fn in a .py file (a module, or the script you "
            f"run) and import it"
        )


def _check_main_guard(frame: Any, caller: str) -> None:
    """Refuse a call from a script's top level that is not under ``if __name__ ==
    "__main__":``: every worker would run the script again, and start workers of its own."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("pshard"):
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "<module>":
        return
    if frame.f_globals.get("__name__") != "__main__":
        return
    path = frame.f_globals.get("__file__")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            end = getattr(node, "end_lineno", None) or line
            if node.lineno <= line <= end:
                return
    raise RuntimeError(
        f"{caller} is called at the top level of {path} (line {line}) without "
        f'`if __name__ == "__main__":`; the worker processes start fresh and import that '
        f"script, so each would call {caller} again. Put the call under "
        f'`if __name__ == "__main__":`'
    )


def _is_main_test(test: Any) -> bool:
    names = {
        n.value if isinstance(n, ast.Constant) else getattr(n, "id", None)
        for n in ast.walk(test)
        if isinstance(n, (ast.Constant, ast.Name))
    }
    return "__name__" in names and "__main__" in names


def _pickle_task(fn: Callable, args: tuple, kwargs: dict, caller: str) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"{caller}: the arguments of fn cannot be pickled into the worker processes ({exc})"
        ) from exc


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        hint = ""
        if -exitcode == signal.SIGABRT:  # gloo aborts the process on mismatched collectives
            hint = (
                " (an abort in the communication library, usually ranks calling different "
                "collectives or shapes: rerun with PSHARD_DEBUG=1 to have it named)"
            )
        return f"was killed by signal {-exitcode} ({name}){hint}"
    return f"exited with code {exitcode}"


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class _Gang:
    """``nprocs`` persistent worker processes sharing one default process group.

    The calling process hosts the rendezvous store on a socket it binds to 127.0.0.1 itself
    (port 0: the kernel picks a free port, so there is no race with other programs), and keeps
    it alive as long as the gang, since the workers use it again whenever they create a group.

    ``call`` runs one task on every rank; on any failure the whole gang is torn down before the
    error is raised (except when every rank finished: then it stays usable). ``close`` stops the
    workers cleanly; ``kill`` tears them down. Neither leaves a process or a zombie behind.
    """

    def __init__(
        self, nprocs: int, *, backend: str = "gloo", pg_timeout_s: float = 1800.0, caller: str
    ) -> None:
        self.nprocs = nprocs
        self.caller = caller
        self.healthy = True
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._controls: list[multiprocessing.connection.Connection] = []
        self._pids: list[int | None] = [None] * nprocs
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(max(128, nprocs))
            port = listener.getsockname()[1]
            timeout = datetime.timedelta(seconds=pg_timeout_s)
            fd = listener.detach()  # the store owns the socket from here on
            try:
                self._store = dist.TCPStore(
                    "127.0.0.1", port, None, True, timeout,
                    wait_for_workers=False, master_listen_fd=fd,
                )  # fmt: skip
            except BaseException:
                os.close(fd)
                raise
        finally:
            listener.close()
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(nprocs):
                ours, theirs = ctx.Pipe(duplex=True)
                control, their_control = ctx.Pipe(duplex=True)
                self._conns.append(ours)
                self._controls.append(control)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, nprocs, backend, port, theirs, pg_timeout_s, their_control),
                    name=f"pshard-rank{rank}",
                )
                proc.start()
                theirs.close()
                their_control.close()
                self._procs.append(proc)
                self._pids[rank] = proc.pid
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int | None]:
        return list(self._pids)

    def alive(self) -> bool:
        return self.healthy and bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running

    def wait_ready(self, deadline: float, timeout: float) -> None:
        """Wait until every rank has joined the process group.

        ``deadline`` is a ``time.monotonic()`` time; ``timeout`` (seconds) is only for messages."""
        self._collect("ready", deadline, f"had not joined the process group after {timeout:g} s")

    def call(self, task: bytes, deadline: float, timeout: float) -> list:
        """Run a pickled ``(fn, args, kwargs)`` on every rank; per-rank values in rank order."""
        for conn in self._conns:
            try:
                conn.send_bytes(task)
            except OSError:  # a worker died; _collect reports it with its exit code
                pass
        return self._collect("ok", deadline, f"still running after the timeout of {timeout:g} s")

    def _collect(self, expected: str, deadline: float, late: str) -> list:
        n = self.nprocs
        values: dict[int, Any] = {}
        errors: dict[int, tuple] = {}
        died: dict[int, int | None] = {}
        healths: set = set()
        pending = set(range(n))
        first: tuple[bool, int] | None = None  # the failure to report: (is a death, rank)
        failed_at = 0.0
        returned_at: float | None = None  # when a rank first returned while others ran on
        stuck: dict[int, tuple[str, float]] = {}  # rank -> (where it waits, since when)
        self.healthy = False  # until every rank has answered (an interrupt leaves it so)
        while pending:
            limit = deadline if first is None else min(deadline, failed_at + _GRACE_S)
            if first is None and returned_at is not None and expected == "ok":
                limit = min(limit, time.monotonic() + _PROBE_S)
                waiting = self._waiting(pending, stuck)
                if waiting is not None:
                    self.kill()
                    raise self._early_return(sorted(values), waiting)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                if first is None and returned_at is not None and time.monotonic() < deadline:
                    continue
                break
            waitables: dict[Any, int] = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            failures: list[tuple[bool, int]] = []
            for obj in multiprocessing.connection.wait(list(waitables), remaining):
                r = waitables[obj]
                if r not in pending:
                    continue
                pending.discard(r)
                message = self._receive(r, obj)
                if message is None:
                    died[r] = self._procs[r].exitcode
                    failures.append((True, r))
                elif message[0] == "err":
                    errors[r] = message[1]
                    healths.add(message[2])
                    failures.append((False, r))
                else:
                    values[r] = message[1]
                    healths.add(message[2])
                    if expected == "ready":
                        self._pids[r] = message[1]
                    elif returned_at is None:
                        returned_at = time.monotonic()
            if failures and first is None:
                failed_at = time.monotonic()
            if failures and (first is None or not first[0]):
                # Report the first death (it makes its peers' collectives fail), else the
                # exception of the lowest rank: the same one whatever order they arrive in.
                first = min(failures + ([first] if first else []), key=lambda f: (not f[0], f[1]))
        # Reusable when every rank answered and all agree on their groups (else later
        # collectives would mismatch and hang).
        self.healthy = not (pending or died) and len(healths) == 1 and next(iter(healths))[0]
        if first is None and not pending:
            return [values[r] for r in range(n)]
        if pending or died:
            self.kill()
        if first is None:
            raise TimeoutError(
                f"{self.caller}: {_ranks_text(pending)} of {n} {late}; all ranks were terminated"
            )
        raise self._error(first, errors, died, sorted(pending))

    def _waiting(
        self, pending: set[int], stuck: dict[int, tuple[str, float]]
    ) -> tuple[int, str] | None:
        """A pending rank that has been waiting in the same collective for ``_STUCK_S`` while
        another rank has returned: ``(rank, where)``; else ``None``. (It waits for a rank
        that will never call that collective.)"""
        now = time.monotonic()
        for r in sorted(pending):
            try:
                self._controls[r].send("where")
                inside, where = (
                    self._controls[r].recv() if self._controls[r].poll(1.0) else (False, "")
                )
            except (EOFError, OSError):
                inside, where = False, ""
            if not inside:
                stuck.pop(r, None)
                continue
            if r not in stuck or stuck[r][0] != where:
                stuck[r] = (where, now)
            elif now - stuck[r][1] >= _STUCK_S:
                return r, where
        return None

    def _early_return(self, returned: list[int], waiting: tuple[int, str]) -> SpawnError:
        rank, where = waiting
        return SpawnError(
            f"{self.caller}: {_ranks_text(returned)} of {self.nprocs} returned while rank {rank} "
            f"is still waiting in a collective ({where}) for more than {_STUCK_S:g} s: every "
            f"rank must call the same collectives, and the returning rank never called this "
            f"one; all ranks were terminated"
        )

    def _receive(self, rank: int, ready: Any) -> tuple | None:
        """The message from ``rank`` (``ready``: its connection or its sentinel), or ``None``
        when the worker is gone (then it has exited: its exit code is set)."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        self._procs[rank].join(_TERM_WAIT_S if ready is conn else None)
        return None

    def _error(
        self,
        first: tuple[bool, int],
        errors: dict[int, tuple],
        died: dict[int, int | None],
        torn_down: list[int],
    ) -> BaseException:
        """The exception for a failed run: the first failure, with notes on the others."""
        n, caller = self.nprocs, self.caller
        is_death, rank = first

        def death(r: int) -> str:
            return f"rank {r} of {n} (pid {self._pids[r]}) {_exit_text(died[r])} without returning"

        notes = [
            f"rank {r} also raised {errors[r][1].rsplit('.', 1)[-1]}"
            for r in sorted(errors)
            if (is_death or r != rank)
        ]
        notes += [death(r) for r in sorted(died) if not (is_death and r == rank)]
        if torn_down:
            verb = "was" if len(torn_down) == 1 else "were"
            notes.append(
                f"{_ranks_text(torn_down)} {verb} still running {_GRACE_S:g} s after the failure "
                f"(probably blocked in a collective) and {verb} terminated"
            )
        rest = "".join(f"; {t}" for t in notes)
        tracebacks = "".join(
            f"\n\n--- rank {r} of {n} (pid {self._pids[r]}) ---\n{errors[r][3]}"
            for r in sorted(errors)
        )
        exc: BaseException | None = None
        if is_death:
            exc = SpawnError(f"{caller}: {death(rank)}{rest}")
        else:
            payload, kind, text, _ = errors[rank]
            where = f"{caller}: raised in rank {rank} of {n} (pid {self._pids[rank]})"
            if payload is not None:
                try:
                    exc = pickle.loads(payload)
                except Exception:
                    exc = None
            if exc is None:
                exc = SpawnError(
                    f"{where}: {kind}: {text} (the exception could not be re-created here; "
                    f"its traceback is attached){rest}"
                )
            elif hasattr(exc, "add_note"):
                exc.add_note(where + rest)
        if tracebacks:
            exc.__cause__ = RemoteTraceback(tracebacks)
        return exc

    # -- stopping

    def close(self, timeout: float = 10.0) -> None:
        """Ask every worker to leave the process group and exit; tear down what remains."""
        stop = pickle.dumps(None)
        for conn in self._conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate, then kill, every worker still running; reap all; release the store."""
        self.healthy = False
        alive = [p for p in self._procs if p.is_alive()]
        for proc in alive:
            proc.terminate()
        if alive:
            multiprocessing.connection.wait([p.sentinel for p in alive], _TERM_WAIT_S)
        for proc in alive:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
            proc.close()
        for conn in self._conns + self._controls:
            conn.close()
        self._procs, self._conns, self._controls = [], [], []
        self._store = None


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` fresh local processes and return their results.

    Each process is started with the multiprocessing ``"spawn"`` method and joins a default
    process group of size ``nprocs`` (rank ``i`` is process ``i``) before ``fn`` runs; the
    group is destroyed when ``fn`` returns. The rendezvous store runs in the calling process on
    a free port of 127.0.0.1 (loopback only); gloo also binds its connections to the loopback
    interface unless ``GLOO_SOCKET_IFNAME`` is set. Unless ``OMP_NUM_THREADS`` is set, each
    process uses ``cpu_count // nprocs`` torch threads, so the ranks do not oversubscribe the
    cores they share.

    ``fn`` and ``args`` are pickled into the processes, so ``fn`` must be a function defined at
    the top level of an importable module (or of the script that calls ``spawn``, guarded by
    ``if __name__ == "__main__":``), not a lambda or a nested function; the return values are
    pickled back.

    Failures: a rank that exits or is killed raises :class:`SpawnError`; otherwise an exception
    in a rank (the lowest such rank) is re-raised here as itself, with the remote tracebacks as
    ``__cause__`` and a note naming the rank and what happened to the others, or as
    :class:`SpawnError` when it cannot be re-created; ranks still running 1 s after a failure
    (typically blocked in a collective) are torn down; when ``timeout`` seconds pass first,
    ``TimeoutError`` names the ranks still running. A rank that returns while another waits in
    a collective (one the returning rank never called) is a :class:`SpawnError` within seconds
    naming the collective and the line that called it (the waiting ranks' main threads are
    inspected once a rank has returned; computing ranks are left to finish), and ``sys.exit``
    inside ``fn`` is a :class:`SpawnError` too, never a silent success. In every case all ranks
    are terminated (then killed) and reaped before ``spawn`` raises: none is left running, and
    if the calling process dies (SIGKILL included) every rank ends within a second. A call from
    a script's top level without ``if __name__ == "__main__":``, and ``fn`` defined in
    ``python -c`` or a notebook, are errors saying so.

    Args:
        fn: module-level function run on every rank; it can use ``torch.distributed``
            collectives on the default group and call ``ps.init_mesh`` for a mesh.
        *args: positional arguments passed to ``fn`` on every rank.
        nprocs: number of processes (the world size), ``>= 1``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, rank ``i`` on GPU ``i``).
        timeout: seconds allowed for the whole run, start-up included.

    Returns:
        ``[fn(*args) on rank 0, ..., fn(*args) on rank nprocs - 1]``.

    Example:
        >>> import torch.distributed as dist
        >>> import pshard as ps
        >>> ps.spawn(dist.get_rank, nprocs=2)
        [0, 1]
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"spawn: timeout must be a number of seconds > 0, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"spawn: backend 'nccl' needs one GPU per rank, but nprocs={nprocs} and "
            f"{torch.cuda.device_count()} GPUs are visible; use backend='gloo' or fewer ranks"
        )
    _check_fn(fn, "spawn")
    _check_main_guard(sys._getframe(1), "spawn")
    task = _pickle_task(fn, args, {}, "spawn")
    deadline = time.monotonic() + timeout
    gang = _Gang(nprocs, backend=backend, pg_timeout_s=timeout, caller="spawn")
    try:
        gang.wait_ready(deadline, timeout)
        results = gang.call(task, deadline, timeout)
    except BaseException:
        gang.close(timeout=_TERM_WAIT_S)
        raise
    gang.close(timeout=max(_TERM_WAIT_S, deadline - time.monotonic()))
    return results

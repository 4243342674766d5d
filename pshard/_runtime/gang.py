"""A gang: persistent worker processes that share one default process group.

The machinery under ``ps.spawn`` (one gang for one call) and the tests' worker pool (one gang
kept alive across calls). The caller hosts the rendezvous store; the workers
(:mod:`pshard._runtime.worker`) join once and then run any number of tasks.

Failures are never silent and never leave processes behind: an exception in a rank is re-raised
in the caller with the rank and the remote traceback; a rank that dies, a rank still running a
short grace period after another one failed (typically blocked in a collective waiting for it),
ranks that wait in collectives that cannot complete (:mod:`pshard._runtime.stalls`), and every
rank still running at the deadline are terminated, then killed, then reaped.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import pickle
import signal
import socket
import time
from typing import Any

import torch.distributed as dist

from .messages import Failed, Health, Message, Ready, RemoteTraceback, SpawnError, ranks_text
from .stalls import PROBE_S, Position, Watch
from .worker import worker_main

__all__ = ["TERM_WAIT_S", "Gang"]

# Seconds the other ranks get to finish once one rank has failed, before they are torn down.
_GRACE_S = 1.0
#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
TERM_WAIT_S = 2.0


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


class Gang:
    """``nprocs`` persistent worker processes sharing one default process group.

    The calling process hosts the rendezvous store on a socket it binds to 127.0.0.1 itself
    (port 0: the kernel picks a free port, so there is no race with other programs), and keeps
    it alive as long as the gang, since the workers use it again whenever they create a group.

    ``call`` runs one task on every rank; on any failure the whole gang is torn down before the
    error is raised (except when every rank finished: then it stays usable). ``close`` stops the
    workers cleanly; ``kill`` tears them down. Neither leaves a process or a zombie behind.
    ``caller`` (``"spawn"``, ``"pool.run"``) starts every error message. ``context`` is the
    multiprocessing context the workers start from: ``"spawn"``'s by default (a fresh
    interpreter per rank, the caller's environment as it is at the call).
    """

    def __init__(
        self,
        nprocs: int,
        *,
        backend: str = "gloo",
        pg_timeout_s: float = 1800.0,
        caller: str,
        context: multiprocessing.context.SpawnContext
        | multiprocessing.context.ForkServerContext
        | None = None,
    ) -> None:
        self.nprocs = nprocs
        self.caller = caller
        self.healthy = True
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._controls: list[multiprocessing.connection.Connection] = []
        self._pids: list[int | None] = [None] * nprocs
        self._store: dist.TCPStore | None = None
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
        ctx = context or multiprocessing.get_context("spawn")
        try:
            for rank in range(nprocs):
                ours, theirs = ctx.Pipe(duplex=True)
                control, their_control = ctx.Pipe(duplex=True)
                self._conns.append(ours)
                self._controls.append(control)
                proc = ctx.Process(
                    target=worker_main,
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
        self._collect(False, deadline, f"had not joined the process group after {timeout:g} s")

    def call(self, task: bytes, deadline: float, timeout: float) -> list[Any]:
        """Run a pickled :class:`~pshard._runtime.messages.Task` on every rank; per-rank values
        in rank order."""
        for conn in self._conns:
            try:
                conn.send_bytes(task)
            except OSError:  # a worker died; _collect reports it with its exit code
                pass
        return self._collect(True, deadline, f"still running after the timeout of {timeout:g} s")

    def _collect(self, running: bool, deadline: float, late: str) -> list[Any]:
        """Every rank's answer (``running``: to a task, else to joining the group)."""
        n = self.nprocs
        values: dict[int, Any] = {}
        errors: dict[int, Failed] = {}
        died: dict[int, int | None] = {}
        healths: set[Health] = set()
        pending = set(range(n))
        first: tuple[bool, int] | None = None  # the failure to report: (is a death, rank)
        failed_at = 0.0
        watch = Watch(n, self.caller)
        probe_at = time.monotonic() + PROBE_S  # then the running ranks say where they are
        self.healthy = False  # until every rank has answered (an interrupt leaves it so)
        while pending:
            limit = deadline if first is None else min(deadline, failed_at + _GRACE_S)
            if first is None and running:
                if time.monotonic() >= probe_at:
                    stall = self._probe(watch, pending, values)
                    if stall is not None:
                        self.kill()
                        raise SpawnError(stall)
                    probe_at = time.monotonic() + PROBE_S
                limit = min(limit, probe_at)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                if first is None and running and time.monotonic() < deadline:
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
                    continue
                healths.add(message.health)
                if isinstance(message, Failed):
                    errors[r] = message
                    failures.append((False, r))
                elif isinstance(message, Ready):
                    values[r] = self._pids[r] = message.pid
                else:
                    values[r] = message.value
            if failures and first is None:
                failed_at = time.monotonic()
            if failures and (first is None or not first[0]):
                # Report the first death (it makes its peers' collectives fail), else the
                # exception of the lowest rank: the same one whatever order they arrive in.
                first = min(failures + ([first] if first else []), key=lambda f: (not f[0], f[1]))
        # Reusable when every rank answered and all agree on their groups (else later
        # collectives would mismatch and hang).
        self.healthy = (
            not (pending or died) and len(healths) == 1 and next(iter(healths)).initialized
        )
        if first is None and not pending:
            return [values[r] for r in range(n)]
        if pending or died:
            self.kill()
        if first is None:
            raise TimeoutError(
                f"{self.caller}: {ranks_text(pending)} of {n} {late}; all ranks were terminated"
            )
        raise self._error(first, errors, died, sorted(pending))

    def _probe(self, watch: Watch, pending: set[int], returned: dict[int, Any]) -> str | None:
        """Ask the ranks still running where they are; the error text when they cannot finish
        (:meth:`pshard._runtime.stalls.Watch.stall`)."""
        for r in pending:
            try:
                self._controls[r].send("where")
            except (EOFError, OSError):
                pass
        for r in sorted(pending):
            where: Position | None = None
            try:
                if self._controls[r].poll(1.0):
                    while True:  # the latest answer (an earlier one may have come late)
                        where = self._controls[r].recv()
                        if not self._controls[r].poll(0):
                            break
            except (EOFError, OSError):
                where = None
            watch.see(r, where, time.monotonic())
        return watch.stall(pending, set(returned), time.monotonic())

    def _receive(self, rank: int, ready: Any) -> Message | None:
        """The message from ``rank`` (``ready``: its connection or its sentinel), or ``None``
        when the worker is gone (then it has exited: its exit code is set)."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                message: Message = pickle.loads(conn.recv_bytes())
                return message
        except (EOFError, OSError):
            pass
        self._procs[rank].join(TERM_WAIT_S if ready is conn else None)
        return None

    def _error(
        self,
        first: tuple[bool, int],
        errors: dict[int, Failed],
        died: dict[int, int | None],
        torn_down: list[int],
    ) -> BaseException:
        """The exception for a failed run: the first failure, with notes on the others."""
        n, caller = self.nprocs, self.caller
        is_death, rank = first

        def death(r: int) -> str:
            return f"rank {r} of {n} (pid {self._pids[r]}) {_exit_text(died[r])} without returning"

        notes = [
            f"rank {r} also raised {errors[r].name}"
            for r in sorted(errors)
            if (is_death or r != rank)
        ]
        notes += [death(r) for r in sorted(died) if not (is_death and r == rank)]
        if torn_down:
            verb = "was" if len(torn_down) == 1 else "were"
            notes.append(
                f"{ranks_text(torn_down)} {verb} still running {_GRACE_S:g} s after the failure "
                f"(probably blocked in a collective) and {verb} terminated"
            )
        rest = "".join(f"; {t}" for t in notes)
        tracebacks = "".join(
            f"\n\n--- rank {r} of {n} (pid {self._pids[r]}) ---\n{errors[r].traceback}"
            for r in sorted(errors)
        )
        exc: BaseException | None = None
        if is_death:
            exc = SpawnError(f"{caller}: {death(rank)}{rest}")
        else:
            failed = errors[rank]
            where = f"{caller}: raised in rank {rank} of {n} (pid {self._pids[rank]})"
            if failed.payload is not None:
                try:
                    exc = pickle.loads(failed.payload)
                except Exception:
                    exc = None
            if exc is None:
                exc = SpawnError(
                    f"{where}: {failed.kind}: {failed.text} (the exception could not be "
                    f"re-created here; its traceback is attached){rest}"
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
            multiprocessing.connection.wait([p.sentinel for p in alive], TERM_WAIT_S)
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

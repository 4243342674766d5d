"""One worker process of a gang: join the process group, then run tasks until told to stop.

:func:`worker_main` is the body of each process a :class:`~pshard._runtime.gang.Gang` starts
(the multiprocessing ``"spawn"`` method). It speaks the protocol of
:mod:`pshard._runtime.messages` over one pipe, and answers the caller's ``"where"`` over a
second one from a thread of its own (:func:`pshard._runtime.stalls.position`), which also ends
the process within a fraction of a second of the caller's death.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist

from .._compat import group_count
from .debug import sequence_state
from .messages import Done, Health, Ready, SpawnError, Task, check_result, failure, send
from .stalls import Position, position

__all__ = ["worker_main"]

# How often a worker checks that its caller is still alive.
_WATCH_S = 0.2


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _health() -> Health:
    return Health(dist.is_initialized(), group_count(), sequence_state())


def _watch_caller(caller: int, control: multiprocessing.connection.Connection) -> None:
    """End this worker within a fraction of a second of its caller's death (SIGKILL included),
    so that no rank outlives the process that spawned it: the caller is gone when this
    process's parent changes (it is re-parented). The same thread answers the caller's
    ``"where"``: where the main thread is (a :class:`~pshard._runtime.stalls.Position`)."""
    main = threading.main_thread().ident

    def watch() -> None:
        while os.getppid() == caller:
            try:
                if control.poll(_WATCH_S) and control.recv() == "where":
                    try:
                        where = position(main)
                    except Exception:  # a frame that cannot be read: say nothing of it
                        where = Position("computing")
                    control.send(where)
            except (EOFError, OSError):
                time.sleep(_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="pshard-caller-watch", daemon=True).start()


def worker_main(
    rank: int,
    nprocs: int,
    backend: str,
    port: int,
    conn: multiprocessing.connection.Connection,
    pg_timeout_s: float,
    control: multiprocessing.connection.Connection,
) -> None:
    """Body of one worker: join the process group, then run tasks until told to stop.

    The worker first sends :class:`~pshard._runtime.messages.Ready` (or ``Failed``); then for
    every pickled :class:`~pshard._runtime.messages.Task` it answers ``Done`` or ``Failed``;
    ``None`` (or the caller going away) stops it.
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
            send(conn, failure(exc, _health(), "while joining the process group"))
            return
        send(conn, Ready(os.getpid(), _health()))
        _serve(rank, nprocs, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
        # The interpreter's last garbage collections over torch's object graph take seconds
        # when several workers exit at once; exiting needs none of them.
        gc.freeze()


def _serve(rank: int, nprocs: int, conn: multiprocessing.connection.Connection) -> None:
    """Run tasks from ``conn`` until ``None`` comes or the caller goes away."""
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the caller is gone
            return
        try:
            task: Task | None = pickle.loads(data)
            if task is None:
                return
            value = task.fn(*task.args, **task.kwargs)
            check_result(value, "spawn", rank, nprocs)
        except SystemExit as exc:  # re-raised in the caller it would end the caller quietly
            error = SpawnError(
                f"fn called sys.exit({exc.code!r}) in rank {rank} of {nprocs}; return from "
                f"fn instead (a rank that exits leaves its peers waiting in collectives)"
            )
            send(conn, failure(error, _health()))
            continue
        except BaseException as exc:
            send(conn, failure(exc, _health()))
            continue
        try:
            message = pickle.dumps(Done(value, _health()))
        except BaseException as exc:
            send(conn, failure(exc, _health(), "while pickling the return value to send it back"))
            continue
        conn.send_bytes(message)

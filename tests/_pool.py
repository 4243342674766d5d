"""The multi-rank test harnesses: in-process ranks (the ``pool`` fixture) and a pool of
persistent gloo workers (the ``procs`` fixture, for the tests where processes are the point).

``ThreadPool.run`` runs ``fn`` on in-process ranks (``ps.spawn(..., backend="threads")``'s
machinery): nothing starts up, nothing is pickled, and the numbers are those of gloo processes.
Each rank starts like a worker of the process pool: ``torch.manual_seed(0)`` and a fresh
``contextvars.Context()``.

The rest of this docstring is the process pool's.

One gang of ``nprocs`` workers per world size, started on first use and reused by later tests
(process group kept alive). Built on ``pshard._runtime.gang.Gang``, the machinery under
``ps.spawn``: same rendezvous, remote tracebacks, stall detection and teardown. The workers are
forked from a server that imported torch and pshard once (multiprocessing's forkserver), so
that a gang torn down by a failure test starts again in a fraction of a second rather than an
import of torch per rank; ``ps.spawn`` starts fresh interpreters (tests/test_spawn.py).

    results = pool.run(nprocs, fn, *args, timeout=120.0, **kwargs)  # per-rank values, rank order

``fn`` must be a module-level function of a test module (pickled by reference). In each worker it
runs in a fresh ``contextvars.Context()`` (no current mesh leaks between tests), after
``torch.manual_seed(0)`` and ``torch.set_num_threads(1)``, with the warning filters, the default
dtype and the grad mode restored afterwards.

If any rank raises, ``run`` raises that exception (original type when picklable, the rank in a
note, remote tracebacks as ``__cause__``), else ``pshard.SpawnError``. The gang survives when every
rank finished (returned or raised) and the ranks still agree on their process groups; it is torn
down, and started again on next use, when a rank died, a rank was still running a second after
another failed (stuck in a collective), ranks waited in collectives that cannot complete (a rank
that returned, or ranks waiting for each other), ``timeout`` passed, or the groups diverged.
"""

from __future__ import annotations

import contextvars
import multiprocessing
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pshard._runtime.gang import Gang
from pshard._runtime.spawn import check_fn, pickle_task
from pshard._runtime.threads import run_threads

# Seconds a fresh gang may take to start (imports of torch on a loaded 2-core machine).
_STARTUP_TIMEOUT_S = 120.0


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs in the worker: ``fn`` with per-test state reset and restored."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        with warnings.catch_warnings():
            return contextvars.Context().run(fn, *args, **kwargs)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


class WorkerPool:
    """Persistent worker gangs keyed by world size. See the module docstring."""

    def __init__(self, backend: str = "gloo") -> None:
        self._backend = backend
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["torch", "pshard"])
        self._gangs: dict[int, Gang] = {}
        self.starts: dict[int, int] = {}  # gangs started per world size (restarts are visible)

    def _gang(self, nprocs: int) -> Gang:
        gang = self._gangs.get(nprocs)
        if gang is not None and gang.alive():
            return gang
        if gang is not None:
            self._gangs.pop(nprocs).kill()
        gang = Gang(nprocs, backend=self._backend, caller="pool.run", context=self._context)
        self.starts[nprocs] = self.starts.get(nprocs, 0) + 1
        try:
            gang.wait_ready(time.monotonic() + _STARTUP_TIMEOUT_S, _STARTUP_TIMEOUT_S)
        except BaseException:
            gang.kill()
            raise
        self._gangs[nprocs] = gang
        return gang

    def pids(self, nprocs: int) -> list[int | None]:
        """Process ids of the live gang of ``nprocs`` workers (empty when there is none)."""
        gang = self._gangs.get(nprocs)
        return gang.pids if gang is not None and gang.alive() else []

    def run(self, nprocs: int, fn: Callable, /, *args: Any, timeout: float = 120.0, **kwargs: Any):
        """``fn(*args, **kwargs)`` on every rank of the ``nprocs`` gang; values in rank order."""
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"pool.run: nprocs must be an int >= 1, got {nprocs!r}")
        check_fn(fn, "pool.run")
        task = pickle_task(_call, (fn, args, kwargs), {}, "pool.run")
        gang = self._gang(nprocs)
        try:
            return gang.call(task, time.monotonic() + timeout, timeout)
        finally:
            if not gang.alive():
                gang.kill()
                self._gangs.pop(nprocs, None)

    def close(self) -> None:
        """Stop every gang: workers leave their process group and exit; nothing is left."""
        gangs, self._gangs = self._gangs, {}
        for gang in gangs.values():
            gang.close()


def _call_in_thread(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs in each in-process rank (a fresh context already): ``fn`` after seeding."""
    torch.manual_seed(0)
    return fn(*args, **kwargs)


class ThreadPool:
    """``pool.run(nprocs, fn, *args, timeout=120.0, **kwargs)`` on in-process ranks."""

    def run(self, nprocs: int, fn: Callable, /, *args: Any, timeout: float = 120.0, **kwargs: Any):
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"pool.run: nprocs must be an int >= 1, got {nprocs!r}")
        return run_threads(_call_in_thread, (fn, args, kwargs), {}, nprocs, timeout, "pool.run")

"""``ps.spawn``: run a function on several fresh local processes that share a process group.

:func:`spawn` checks what it is given (``fn`` importable by the workers, the call guarded by
``if __name__ == "__main__":``, the arguments picklable) before any process starts, then runs
``fn`` once on a :class:`~pshard._runtime.gang.Gang` of fresh processes and tears it down.
:func:`check_fn` and :func:`pickle_task` serve every caller of a gang (the tests' pool too).
"""

from __future__ import annotations

import ast
import functools
import inspect
import pickle
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from .gang import TERM_WAIT_S, Gang
from .messages import RemoteTraceback, SpawnError, Task
from .threads import run_threads
from .tracing import refuse

__all__ = ["RemoteTraceback", "SpawnError", "check_fn", "pickle_task", "spawn"]


def check_not_generator(fn: object, caller: str) -> None:
    """Refuse a generator function or a coroutine function (a ``functools.partial`` of one
    too): a rank would return the generator or coroutine, never run."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    kinds = (
        (inspect.isgeneratorfunction, "a generator function", "return a list instead of yielding"),
        (inspect.isasyncgenfunction, "an async generator function", "return a list"),
        (inspect.iscoroutinefunction, "a coroutine function", "call asyncio.run(...) inside fn"),
    )
    for test, kind, fix in kinds:
        if test(inner):
            name = getattr(inner, "__qualname__", repr(inner))
            raise TypeError(
                f"{caller}: fn ({name}) is {kind}: each rank would return a "
                f"{'coroutine' if 'coroutine' in kind else 'generator'} that never ran; make fn "
                f"a plain function ({fix})"
            )


def check_fn(fn: object, caller: str) -> None:
    """Refuse, before any process starts, a ``fn`` the worker processes cannot import: not
    callable, a lambda or a nested function, unpicklable, or defined where no file holds it
    (``python -c``, standard input, an interactive session, a notebook)."""
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"{caller}: fn {qualname!r} is a lambda or a function defined inside another "
            "function, which cannot be pickled into the worker processes; define it at the top "
            "level of a module (functions are pickled by module and name), or run the ranks as "
            "threads of this process: backend='threads'"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{caller}: fn {fn!r} cannot be pickled into the worker processes ({exc}); pass a "
            "function defined at the top level of an importable module, or run the ranks as "
            "threads of this process: backend='threads'"
        ) from exc
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    # `python -c` and notebooks give no file, standard input (`python - <<EOF`) "<stdin>",
    # which the workers would try to run as a script
    if getattr(fn, "__module__", None) == "__main__" and (
        not main_file
        or not isinstance(main_file, str)
        or (main_file.startswith("<") and main_file.endswith(">"))
    ):
        raise TypeError(
            f"{caller}: fn {qualname!r} is defined in `python -c`, an interactive session or a "
            f"notebook, where the worker processes cannot import it from (they start fresh and "
            f"import fn by module and name); run the ranks as threads of this process instead "
            f"(backend='threads'), or put fn in a .py file (a module, or the script you run) "
            f"and import it"
        )


def _check_main_guard(frame: FrameType | None, caller: str) -> None:
    """Refuse a call from a script's top level that is not under ``if __name__ ==
    "__main__":``: every worker would run the script again, and start workers of its own."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("pshard"):
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "<module>":
        return
    if frame.f_globals.get("__name__") != "__main__":
        return
    path = frame.f_globals.get("__file__")
    if not isinstance(path, str):
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
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


def _is_main_test(test: ast.expr) -> bool:
    names = {
        n.value if isinstance(n, ast.Constant) else getattr(n, "id", None)
        for n in ast.walk(test)
        if isinstance(n, (ast.Constant, ast.Name))
    }
    return "__name__" in names and "__main__" in names


def pickle_task(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], caller: str
) -> bytes:
    """``fn(*args, **kwargs)`` as a :class:`~pshard._runtime.messages.Task` for a gang, pickled
    here so that an argument the workers cannot receive is an error before anything runs."""
    try:
        return pickle.dumps(Task(fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"{caller}: the arguments of fn cannot be pickled into the worker processes ({exc}); "
            f"backend='threads' passes them as they are"
        ) from exc


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes (or threads) and return their results.

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
    naming the collective and the line that called it (the running ranks' main threads are
    inspected every second; computing ranks are left to finish). With debug mode on, so are
    ranks that wait for each other in different collectives (one skipped a collective and waits
    in the next) and debug mode on in only some ranks (docs: "When something goes wrong").
    ``sys.exit`` inside ``fn`` is a :class:`SpawnError` too, never a silent success. In every
    case all ranks are terminated (then killed) and reaped before ``spawn`` raises: none is left
    running, and if the calling process dies (SIGKILL included) every rank ends within a second.
    A call from
    a script's top level without ``if __name__ == "__main__":``, and ``fn`` defined in
    ``python -c``, standard input (``python - <<EOF``) or a notebook, are errors saying so
    before any process starts.

    With ``backend="threads"`` the ranks are threads of the calling process over an
    in-process transport (docs: "Notebooks and tests"): any callable works (a lambda, a closure,
    a function defined in a notebook or ``python -c``), nothing is pickled or copied (every
    rank gets the very argument objects; the caller gets each rank's own result), nothing starts
    up, and every pshard feature gives the numbers gloo processes give. The ranks take turns
    (one runs at a time), each with its own ``torch.distributed`` rank, current mesh, random
    state (a fresh process's: seed it in ``fn``) and default dtype. An exception in a rank is
    re-raised here as itself with a note naming the rank, ranks waiting for it are released at
    once, and ranks that wait for each other for good are a :class:`SpawnError` naming where
    each waits; after ``timeout`` the ranks are stopped. NCCL and ``torch.compile`` of pshard's
    collectives do not run on threads (clear errors).

    Args:
        fn: module-level function run on every rank; it can use ``torch.distributed``
            collectives on the default group and call ``ps.init_mesh`` for a mesh.
        *args: positional arguments passed to ``fn`` on every rank.
        nprocs: number of processes (the world size), ``>= 1``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, rank ``i`` on GPU ``i``)
            processes, or ``"threads"``: the ranks are threads of this process (below).
        timeout: seconds allowed for the whole run, start-up included.

    Returns:
        ``[fn(*args) on rank 0, ..., fn(*args) on rank nprocs - 1]``.

    Example:
        >>> import torch.distributed as dist
        >>> import pshard as ps
        >>> ps.spawn(dist.get_rank, nprocs=2)
        [0, 1]
        >>> ps.spawn(lambda: 10 * dist.get_world_size() + dist.get_rank(), nprocs=3,
        ...          backend="threads")
        [30, 31, 32]
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"spawn: timeout must be a number of seconds > 0, got {timeout!r}")
    if backend not in ("gloo", "nccl", "threads"):
        raise ValueError(f"spawn: backend must be 'gloo', 'nccl' or 'threads', got {backend!r}")
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    check_not_generator(fn, "spawn")
    refuse("ps.spawn", "it starts ranks (spawn them first; each rank runs its program)")
    if backend == "threads":
        return run_threads(fn, args, {}, nprocs, timeout, "spawn")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"spawn: backend 'nccl' needs one GPU per rank, but nprocs={nprocs} and "
            f"{torch.cuda.device_count()} GPUs are visible; use backend='gloo' or fewer ranks"
        )
    check_fn(fn, "spawn")
    _check_main_guard(sys._getframe(1), "spawn")
    task = pickle_task(fn, args, {}, "spawn")
    deadline = time.monotonic() + timeout
    gang = Gang(nprocs, backend=backend, pg_timeout_s=timeout, caller="spawn")
    try:
        gang.wait_ready(deadline, timeout)
        results = gang.call(task, deadline, timeout)
    except BaseException:
        gang.close(timeout=TERM_WAIT_S)
        raise
    gang.close(timeout=max(TERM_WAIT_S, deadline - time.monotonic()))
    return results

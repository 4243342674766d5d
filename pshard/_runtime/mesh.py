"""The device mesh: creating it, making it current, and resolving axis names to process groups.

The mesh is a plain :class:`torch.distributed.device_mesh.DeviceMesh` with ``mesh_dim_names``;
pshard adds no mesh class and writes nothing into it. The current mesh lives in a context
variable, so it is restored on exit from :func:`use_mesh` and is private to each thread and task;
beside it the context holds the axes already resolved in that mesh (a mesh's groups and this
rank's place in them never change), so a collective pays one dict lookup, not a group lookup.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import itertools
import math
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._compat import THREADS_BACKEND, flattened_group
from .._core.checks import axis_names
from .turns import RANK_THREAD, current_task

__all__ = [
    "Axis",
    "AxisInfo",
    "cpu_group",
    "current_mesh",
    "init_mesh",
    "mapped_axes",
    "mapping",
    "mesh_for",
    "named_axis",
    "resolve_axis",
    "use_mesh",
]


class _Scope(NamedTuple):
    """The current mesh and the axes resolved in it (axis -> AxisInfo)."""

    mesh: DeviceMesh
    axes: dict[str | tuple[str, ...], AxisInfo]


_CURRENT_MESH: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "pshard_current_mesh", default=None
)


_MAPPED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "pshard_mapped_axes", default=()
)


def mapped_axes() -> tuple[str, ...]:
    """The mesh axes the maps running now map (``shard_map`` bodies inside each other: all
    of theirs), outermost first."""
    return _MAPPED.get()


@contextlib.contextmanager
def mapping(axes: tuple[str, ...]) -> Iterator[None]:
    """The body of a map over ``axes`` (see :func:`mapped_axes`)."""
    token = _MAPPED.set(_MAPPED.get() + tuple(a for a in axes if a not in _MAPPED.get()))
    try:
        yield
    finally:
        _MAPPED.reset(token)


def _scope_for(mesh: DeviceMesh) -> _Scope:
    """A scope for ``mesh``: the current one when it holds the same mesh (its cache is kept)."""
    scope = _CURRENT_MESH.get()
    return scope if scope is not None and scope.mesh is mesh else _Scope(mesh, {})


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

Axis = str | tuple[str, ...] | dist.ProcessGroup


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _creation_timeout() -> datetime.timedelta:
    """How long the ranks of a torchrun job may take to join the process groups
    (``PSHARD_INIT_TIMEOUT`` seconds, default 120): a rank that never comes is an error after
    it, not a wait of torch's 30 minutes."""
    text = os.environ.get("PSHARD_INIT_TIMEOUT", "120")
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"init_mesh: PSHARD_INIT_TIMEOUT={text!r} is not a number of seconds"
        ) from None
    return datetime.timedelta(seconds=seconds)


def _init_default_group(backend: str | None) -> None:
    """Initialise the default process group: torchrun's environment when present, else a
    world of one process (an in-memory store, no network).

    Under torchrun the keys of this attempt's groups live under a prefix of their own
    (``TORCHELASTIC_RESTART_COUNT``): a restarted job's store may still hold the previous
    attempt's (the addresses of ranks that are gone), which gloo would try to connect to."""
    backend = backend or _default_backend()
    if _torchrun():
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = _creation_timeout()
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"pshard/attempt-{attempt}/", store)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _device_type() -> str:
    backend = str(dist.get_backend()).lower()
    return "cuda" if "nccl" in backend else "cpu"


def init_mesh(shape: dict[str, int] | None = None, *, backend: str | None = None) -> DeviceMesh:
    """Create a device mesh over all ranks and make it the current mesh.

    Initialises the default process group first when none exists: from torchrun's environment
    when it is set, else a single-process group (world size 1), so the same code runs on a
    laptop, under ``ps.spawn`` and under torchrun. The backend is NCCL when CUDA is available and
    gloo otherwise, unless ``backend`` is given.

    Args:
        shape: mesh axis name -> size, major to minor; the sizes must multiply to the world
            size. ``None`` means one axis ``"world"`` over all ranks.
        backend: process-group backend for a group created here; with an existing default
            group it must be that group's (or left out).

    Returns:
        A ``DeviceMesh`` with ``mesh_dim_names`` equal to ``shape``'s keys.

    Raises:
        ValueError: an unknown backend, ``"nccl"`` without CUDA, a backend other than the
            existing group's, or sizes that do not multiply to the world size. Nothing is left
            initialised by a call that raises.

    Example:
        >>> import pshard as ps
        >>> mesh = ps.init_mesh()
        >>> mesh.mesh_dim_names, mesh.size()
        (('world',), 1)
        >>> ps.current_mesh() is mesh
        True
    """
    if shape is not None and (not isinstance(shape, dict) or not shape):
        raise TypeError(
            f"init_mesh: shape must be a non-empty dict of axis name -> size, got {shape!r}"
        )
    for name, size in (shape or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"init_mesh: axis names must be str, got {name!r} in shape {shape!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"init_mesh: axis {name!r} has size {size!r}; sizes must be ints >= 1")
    created = False
    if dist.is_initialized():
        world = dist.get_world_size()
        current = str(dist.get_backend()).lower()
        if backend is not None and backend.lower() not in current.split(":"):
            if current == THREADS_BACKEND:
                raise ValueError(
                    f"init_mesh: backend={backend!r} in an in-process rank (ps.spawn(..., "
                    f"backend='threads')), whose ranks are threads of one process and "
                    f"communicate in memory; {backend} needs ranks of their own: ps.spawn(..., "
                    f"backend={backend!r}) or torchrun (or leave backend out)"
                )
            raise ValueError(
                f"init_mesh: backend={backend!r} but the default process group already exists "
                f"with backend {current!r}; a backend can only be chosen when the group is "
                f"created (leave backend out, or destroy the group first)"
            )
    else:
        backend = _check_backend(backend)
        world = int(os.environ["WORLD_SIZE"]) if _torchrun() else 1
    if shape is None:
        shape = {"world": world}
    if math.prod(shape.values()) != world:
        raise ValueError(
            f"init_mesh: shape {shape} has {math.prod(shape.values())} ranks but the world has "
            f"{world}; make the sizes multiply to {world}"
        )
    joining = not dist.is_initialized() and _torchrun()  # ranks join over the network
    try:
        if not dist.is_initialized():
            _init_default_group(backend)
            created = True
        mesh = init_device_mesh(
            _device_type(), tuple(shape.values()), mesh_dim_names=tuple(shape.keys())
        )
    except BaseException as e:
        if created:  # leave no half-made state behind
            dist.destroy_process_group()
        if joining and isinstance(e, (RuntimeError, dist.DistError)) and _timed_out(e):
            raise RuntimeError(
                f"init_mesh: the {world} ranks of this torchrun job did not all join the process "
                f"groups within {_creation_timeout().total_seconds():g} s: a rank was lost or "
                f"never started (torchrun restarts the job when --max-restarts allows, each "
                f"attempt's groups apart from the last's), or the ranks disagree on the world "
                f"size; PSHARD_INIT_TIMEOUT sets the wait ({type(e).__name__}: {e})"
            ) from e
        raise
    if joining:  # the groups are made: their collectives get torch's usual time again
        # and they are taken down when the process ends (a process exiting with its groups
        # alive can abort in their threads' teardown: "terminate called without an active
        # exception", after its work was done)
        atexit.register(_destroy_at_exit)
        regular = _regular_timeout(backend)
        groups = [g for g in [dist.group.WORLD, *mesh.get_all_groups()] if g is not None]
        for group in {id(g): g for g in groups}.values():
            group.set_timeout(regular)
    _CURRENT_MESH.set(_Scope(mesh, {}))
    return mesh


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return any(w in text for w in ("timed out", "timeout", "connectfullmesh", "connection refused"))


def _regular_timeout(backend: str | None) -> datetime.timedelta:
    """torch's default timeout of a process group's collectives for ``backend``."""
    from torch.distributed import constants

    if str(backend or dist.get_backend()).lower() == "nccl":
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout
    return constants.default_pg_timeout


def _torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def _check_backend(backend: str | None) -> str:
    """The backend for a new default group (``backend`` checked, else the default)."""
    if backend is None:
        return _default_backend()
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if not isinstance(backend, str) or backend.lower() not in known:
        raise ValueError(
            f"init_mesh: backend={backend!r} is not a torch.distributed backend; use one of "
            f"{', '.join(map(repr, known))} (or leave it out: nccl with CUDA, gloo without)"
        )
    if backend.lower() == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "init_mesh: backend='nccl' needs CUDA GPUs, and none is available here; use "
            "backend='gloo' on CPU (or leave it out)"
        )
    return backend.lower()


@contextlib.contextmanager
def use_mesh(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """Make ``mesh`` the current mesh inside the ``with`` block; the previous one comes back on
    exit (also on an exception).

    Example:
        >>> import pshard as ps
        >>> mesh = ps.init_mesh({"sp": 1})
        >>> with ps.use_mesh(mesh):
        ...     ps.current_mesh().mesh_dim_names
        ('sp',)
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"use_mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    token = _CURRENT_MESH.set(_scope_for(mesh))
    try:
        yield mesh
    finally:
        _CURRENT_MESH.reset(token)


def current_mesh() -> DeviceMesh:
    """The mesh set by the innermost :func:`use_mesh`, else the last :func:`init_mesh`.

    Raises:
        RuntimeError: when there is none.
    """
    return mesh_for("pshard")


def mesh_for(fn: str) -> DeviceMesh:
    """:func:`current_mesh` for the function ``fn``, which the error names when there is none."""
    scope = _CURRENT_MESH.get()
    if scope is None:
        if _ranks_running_elsewhere():
            raise RuntimeError(
                f"{fn}: this thread is not a rank: in-process ranks (ps.spawn(..., "
                f"backend='threads')) are running, each on a thread of its own, and a thread "
                f"that one of them starts is not one of them (it has no mesh and no process "
                f"group); communicate from the rank's own thread"
            )
        raise RuntimeError(
            f"{fn}: no current mesh; create one with ps.init_mesh({{...}}) or enter "
            f"ps.use_mesh(mesh)"
        )
    return scope.mesh


def named_axis(axis: object, mesh: DeviceMesh | None, fn: str) -> tuple[DeviceMesh, int]:
    """The mesh (``mesh``, default the current one) and size of the axis named ``axis``, for
    the function ``fn`` that the errors name.

    Raises:
        TypeError: ``axis`` is not a name.
        ValueError: no such axis in the mesh.
    """
    if not isinstance(axis, str):
        raise TypeError(f"{fn}: axis must be a mesh-axis name (str), got {type(axis).__name__}")
    mesh = mesh_for(fn) if mesh is None else mesh
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise ValueError(
            f"{fn}: axis {axis!r} is not an axis of the mesh (axes {names} with sizes "
            f"{tuple(mesh.mesh.shape)}); pass axis= one of them, or a mesh with it"
        )
    return mesh, int(mesh.size(names.index(axis)))


def _ranks_running_elsewhere() -> bool:
    """Whether in-process ranks run in this process while this thread is none of them."""
    if current_task() is not None:
        return False
    return any(t.name.startswith(RANK_THREAD) and t.is_alive() for t in threading.enumerate())


class AxisInfo(NamedTuple):
    """One resolved axis: its process group, size and this rank's index on it.

    ``order[i]`` is the group rank of index ``i`` on the axis when the two differ (a tuple of
    mesh axes named in another order than the mesh's: the group follows the mesh, the indices
    follow the tuple, JAX's rule); ``None`` when they agree."""

    group: dist.ProcessGroup | None  # None when size == 1 (no communication needed)
    size: int
    rank: int
    name: str
    order: tuple[int, ...] | None = None


def resolve_axis(axis: Axis, *, mesh: DeviceMesh | None = None, fn: str = "pshard") -> AxisInfo:
    """Resolve ``axis`` (a mesh-axis name, a tuple of names, or a ProcessGroup) to its group,
    size and this rank's index. A tuple of names is their product, major to minor in the order
    given, as in JAX (``("y", "x")`` on a mesh ``{"x": 2, "y": 2}``: index ``2 * y + x``).

    Raises:
        RuntimeError: no default process group (destroyed, or never initialised), or no
            current mesh.
        ValueError: an axis name not in the mesh, or named twice.

    Example:
        >>> import pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1, "sp": 1})
        >>> info = resolve_axis(("dp", "sp"))
        >>> info.size, info.rank, info.name
        (1, 0, 'dp,sp')
    """
    if isinstance(axis, dist.ProcessGroup):
        if not dist.is_initialized():
            raise RuntimeError(_no_group(axis, fn))
        size = dist.get_world_size(axis)
        return AxisInfo(axis if size > 1 else None, size, dist.get_rank(axis), f"group{size}")
    scope = _CURRENT_MESH.get()
    if mesh is None:
        mesh = mesh_for(fn)  # raises when there is none
    if not dist.is_initialized():  # the mesh outlived its groups
        raise RuntimeError(_no_group(axis, fn))
    # axes resolved in the current mesh are cached in its scope; another mesh resolves afresh
    cache = scope.axes if scope is not None and scope.mesh is mesh else {}
    key = (
        axis
        if isinstance(axis, str)
        or (isinstance(axis, tuple) and all(isinstance(a, str) for a in axis))
        else None
    )
    if key is not None and key in cache:
        return cache[key]
    info = _resolve_names(axis_names(axis, fn), mesh, axis, fn)
    if key is not None:
        cache[key] = info
    return info


def _no_group(axis: Axis, fn: str) -> str:
    what = "the process group given" if isinstance(axis, dist.ProcessGroup) else repr(axis)
    return (
        f"{fn}: the default process group was destroyed (torch.distributed."
        f"destroy_process_group) or never initialised, so axis {what} has no process group to "
        f"run on; start one with ps.spawn (local processes), torchrun (a job), or ps.init_mesh "
        f"(a world of one process, or torchrun's environment), then make the mesh again"
    )


def _resolve_names(names: tuple[str, ...], mesh: DeviceMesh, axis: Axis, fn: str) -> AxisInfo:
    dim_names = mesh.mesh_dim_names or ()
    for n in names:
        if n not in dim_names:
            raise ValueError(
                f"{fn}: axis {n!r} is not in the mesh; its axes are {dim_names} with sizes "
                f"{tuple(mesh.shape)}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"{fn}: axis {axis!r} names a mesh axis more than once")
    sizes = [mesh.size(dim_names.index(n)) for n in names]
    size = math.prod(sizes)
    rank = 0
    for n, s in zip(names, sizes, strict=True):
        rank = rank * s + mesh.get_local_rank(n)
    label = ",".join(names)
    if size == 1:
        return AxisInfo(None, 1, 0, label)
    live = [(n, s) for n, s in zip(names, sizes, strict=True) if s > 1]
    if len(live) == 1:
        return AxisInfo(mesh.get_group(live[0][0]), size, rank, label)
    in_mesh = sorted(live, key=lambda pair: dim_names.index(pair[0]))
    group = _flattened_group(mesh, tuple(n for n, _ in in_mesh))
    order = None
    if in_mesh != live:  # indices follow the tuple's order, the group the mesh's
        order = tuple(
            _linear(dict(zip((n for n, _ in live), coords, strict=True)), in_mesh)
            for coords in itertools.product(*(range(s) for _, s in live))
        )
    return AxisInfo(group, size, rank, label, order)


def _linear(coords: dict[str, int], axes: list[tuple[str, int]]) -> int:
    index = 0
    for name, size in axes:
        index = index * size + coords[name]
    return index


def _flattened_group(mesh: DeviceMesh, names: tuple[str, ...]) -> dist.ProcessGroup:
    """The process group spanning several mesh axes (named in the mesh's order).

    DeviceMesh caches flattened meshes on its root mesh, so the group is created once."""
    return flattened_group(mesh[names])


def cpu_group() -> dist.ProcessGroup:
    """A new process group of every rank that moves CPU tensors (Python objects): gloo beside a
    default group of another backend (NCCL), else the default group's own backend (gloo, or
    in-process ranks' transport, on which a gloo group cannot run). Every rank calls it."""
    backend = str(dist.get_backend()).lower()
    if backend in ("gloo", THREADS_BACKEND):
        return dist.new_group()
    return dist.new_group(backend="gloo")

"""Debug mode: run-time checks that every rank issues the same collective.

Debug mode is on when ``PSHARD_DEBUG`` is set to anything but ``""``, ``"0"``, ``"false"`` or
``"off"``, unless :func:`debug` says otherwise for the current context. The switch lives in a
context variable, so it is private to each thread and task and is restored on exit from
``with ps.debug(...)``.

With it on, before each collective the ranks of its group exchange a fixed-size fingerprint
(operation, axis, shape, dtype and the operation's arguments; for a pytree, first its
structure) and a mismatch raises :class:`ValueError` on every rank, naming every rank's call,
instead of hanging or silently combining unrelated tensors.

The fingerprints travel through the process group's key-value store, not through a collective
on the group itself: a rank that skips the collective, calls it with another pytree, or runs
with debug mode off would otherwise pair the fingerprint exchange with a different collective
and hang (or abort). Each rank writes its fingerprint under ``(group, sequence number, rank)``
and waits for the others' for ``PSHARD_DEBUG_TIMEOUT`` seconds (default 60); a rank still
missing then is named in the error. While it waits, the frame of that wait holds a
:class:`CheckWait` (:func:`waiting` reads it, from another thread): ``ps.spawn`` looks there to
name within seconds a rank that returned without the collective or skipped ahead to another
one, and debug mode on in only some ranks (:mod:`pshard._runtime.stalls`).

Process state: the sequence numbers (``_SEQUENCE``) are the one piece of module-level mutable
state in the runtime, and they are not a cache (``ps.clear_caches()`` leaves them alone): one
counter per process group in this process, which every rank advances in step, so that the
ranks' fingerprints of the same collective meet under the same key (debug mode is for finding
where they stop being in step). Everything else lives in context variables.
"""

from __future__ import annotations

import contextvars
import datetime
import os
import time
import zlib
from dataclasses import dataclass
from types import FrameType, MappingProxyType, TracebackType

import torch
import torch.distributed as dist

from .._compat import default_store
from .._core.checks import WIRE_DTYPES
from .turns import Stuck, current_task

__all__ = [
    "CheckWait",
    "DebugScope",
    "check_collective",
    "check_pytree",
    "debug",
    "debug_enabled",
    "group_key",
    "perm_code",
    "sequence_state",
    "waiting",
]

_DEBUG: contextvars.ContextVar[bool | None] = contextvars.ContextVar("pshard_debug", default=None)

_OFF = ("", "0", "false", "off", "no")


def debug_enabled() -> bool:
    """Whether debug mode is on in the current context (:func:`debug`, else ``PSHARD_DEBUG``)."""
    value = _DEBUG.get()
    if value is None:
        return os.environ.get("PSHARD_DEBUG", "").strip().lower() not in _OFF
    return value


class DebugScope:
    """What :func:`debug` returns: the switch is already set; as a context manager it restores
    the previous setting on exit."""

    def __init__(self, token: contextvars.Token[bool | None]) -> None:
        self._token = token

    def __enter__(self) -> DebugScope:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _DEBUG.reset(self._token)

    def __repr__(self) -> str:
        return f"DebugScope(enabled={debug_enabled()})"


def debug(enabled: bool = True) -> DebugScope:
    """Turn pshard's run-time checks on or off for the current context.

    Called as a function it changes the setting for the rest of the current context (thread,
    task, or the enclosing ``with ps.debug(...)`` block); used as a context manager it restores
    the previous setting on exit. Without a call, ``PSHARD_DEBUG=1`` in the environment turns
    the checks on.

    The checks: every rank of a collective's group calls the same collective with the same
    shape, dtype and arguments (a mismatch raises ``ValueError`` on every rank naming each
    rank's call, instead of a hang); other pshard functions add their own (replicated values
    equal across ranks, specs agreeing with shapes). Each check costs a few round trips to the
    process group's store per collective, so leave debug mode off in production runs.

    Args:
        enabled: ``True`` to turn the checks on, ``False`` to turn them off.

    Returns:
        A :class:`DebugScope`, usable as a context manager.

    Example:
        >>> import pshard as ps
        >>> with ps.debug(True):
        ...     ps.debug_enabled()
        True
        >>> with ps.debug(False):
        ...     ps.debug_enabled()
        False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"debug: enabled must be a bool, got {enabled!r}")
    return DebugScope(_DEBUG.set(enabled))


# --- fingerprints -------------------------------------------------------------------------------

_OPS = (
    "pytree",
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "broadcast",
    "reduce",
)
_MAGIC = 0x7073
_MAX_DIMS = 16
_NPARAMS = 6
_LABEL = 32
# layout: magic, op, dtype, ndim, shape[16], params[6], label[32], global rank, group rank
_SHAPE0 = 4
_PARAM0 = _SHAPE0 + _MAX_DIMS
_LABEL0 = _PARAM0 + _NPARAMS
_GRANK = _LABEL0 + _LABEL
_LEN = _GRANK + 2


def perm_code(perm: tuple[tuple[int, int], ...]) -> int:
    """A stable 32-bit code of a permutation, to compare it across ranks."""
    return zlib.crc32(repr(sorted(perm)).encode())


def _encode(
    op: str, label: str, shape: tuple[int, ...], dtype: torch.dtype, params: tuple[int, ...]
) -> list[int]:
    fp = [0] * _LEN
    fp[0] = _MAGIC
    fp[1] = _OPS.index(op)
    fp[2] = WIRE_DTYPES.index(dtype) if dtype in WIRE_DTYPES else len(WIRE_DTYPES)
    fp[3] = len(shape)
    dims = list(shape[:_MAX_DIMS]) + [-1] * max(0, _MAX_DIMS - len(shape))
    if len(shape) > _MAX_DIMS:  # keep the tail comparable without widening the record
        dims[-1] = zlib.crc32(repr(shape[_MAX_DIMS - 1 :]).encode())
    fp[_SHAPE0:_PARAM0] = dims
    fp[_PARAM0 : _PARAM0 + len(params)] = list(params)
    codes = list(label.encode()[:_LABEL])
    fp[_LABEL0 : _LABEL0 + len(codes)] = codes
    fp[_GRANK] = dist.get_rank()
    return fp


_PARAM_NAMES = MappingProxyType(
    {
        "pytree": ("leaves", "structure"),
        "all_gather": ("dim", "tiled"),
        "psum_scatter": ("dim", "tiled"),
        "all_to_all": ("split_dim", "concat_dim"),
        "ppermute": ("perm_code",),
        "broadcast": ("src",),
        "reduce": ("dst",),
    }
)


def _describe(fp: list[int]) -> str:
    if fp[0] != _MAGIC or not 0 <= fp[1] < len(_OPS):
        return "<not a pshard collective>"
    op = _OPS[fp[1]]
    label = bytes(c for c in fp[_LABEL0 : _LABEL0 + _LABEL] if c).decode(errors="replace")
    if op == "pytree":
        leaves, code = fp[_PARAM0], fp[_PARAM0 + 1]
        what = "a tensor" if leaves == 1 and code == 0 else f"a pytree of {leaves} leaves"
        return f"{what} (structure {code:08x}) on axis {label!r}"
    dtype = WIRE_DTYPES[fp[2]] if fp[2] < len(WIRE_DTYPES) else "other"
    ndim = fp[3]
    dims = fp[_SHAPE0 : _SHAPE0 + min(ndim, _MAX_DIMS)]
    shape = "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "")
    shape += ", ...)" if ndim > _MAX_DIMS else ")"
    label = bytes(c for c in fp[_LABEL0 : _LABEL0 + _LABEL] if c).decode(errors="replace")
    args = [f"shape={shape}", f"dtype={dtype}"]
    for i, name in enumerate(_PARAM_NAMES.get(op, ())):
        value = fp[_PARAM0 + i]
        args.append(f"{name}={bool(value)}" if name == "tiled" else f"{name}={value}")
    return f"{op}({', '.join(args)}) on axis {label!r}"


# Process state, not a cache (see the module docs): process group name -> fingerprints
# exchanged so far on it by this process.
_SEQUENCE: dict[str, int] = {}


def sequence_state() -> tuple[tuple[str, int], ...]:
    """This process's debug-mode counters (ranks must agree to stay in step)."""
    return tuple(sorted(_sequences().items()))


def _sequences() -> dict[str, int]:
    """The counters of this rank: the process's, or an in-process rank's own."""
    task = current_task()
    return _SEQUENCE if task is None else task.rank.debug_sequence


def _timeout() -> float:
    try:
        return float(os.environ.get("PSHARD_DEBUG_TIMEOUT", "60"))
    except ValueError:
        return 60.0


def group_key(group: dist.ProcessGroup) -> str:
    """The name the checks file ``group``'s fingerprints under (its ``group_name``)."""
    return getattr(group, "group_name", None) or str(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class CheckWait:
    """What a rank waits for in a check: ``op`` on axis ``label`` (``group``, filed as
    ``name``), its ``seq``-th check on that group, until ``deadline`` (``time.monotonic()``)."""

    op: str
    label: str
    group: dist.ProcessGroup
    name: str
    seq: int
    deadline: float


def waiting(frame: FrameType) -> CheckWait | None:
    """The :class:`CheckWait` of ``frame`` when it is a check waiting for the other ranks'
    fingerprints, else ``None``."""
    if frame.f_code is not _exchange.__code__:
        return None
    wait = frame.f_locals.get("wait")
    return wait if isinstance(wait, CheckWait) else None


def check_pytree(
    op: str, group: dist.ProcessGroup | None, label: str, leaves: int, code: int
) -> None:
    """Compare the structure of a pytree argument (its leaf count and a code of its treedef)
    across the ranks of ``group``, before its leaves are checked one by one; ``group`` is
    ``None`` for an axis of one rank (nothing to compare)."""
    # the operation is left out: a mismatch of operations is named by the leaves' check
    _check(op, group, label, _encode("pytree", label, (), torch.int64, (leaves, code & 0x7FFFFFFF)))


def check_collective(
    op: str,
    group: dist.ProcessGroup | None,
    label: str,
    tensor: torch.Tensor,
    params: tuple[int, ...] = (),
) -> None:
    """Compare this rank's collective call with every other rank's in ``group`` (``None``: an
    axis of one rank, nothing to compare).

    Raises:
        ValueError: on every rank, when any two ranks disagree on the operation, axis, shape,
            dtype or arguments (the message lists each rank's call), and on the ranks that
            reached the collective when another did not within ``PSHARD_DEBUG_TIMEOUT``
            seconds (naming it).
    """
    _check(op, group, label, _encode(op, label, tuple(tensor.shape), tensor.dtype, params))


def _check(op: str, group: dist.ProcessGroup | None, label: str, fp: list[int]) -> None:
    if group is None:
        return
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    fp[_GRANK + 1] = me
    rows = _exchange(op, group, label, fp, size, me)
    keys = [tuple(r[:_GRANK]) for r in rows]
    if all(k == keys[0] for k in keys):
        return
    by_call: dict[tuple[int, ...], list[list[int]]] = {}
    for row, key in zip(rows, keys, strict=True):
        by_call.setdefault(key, []).append(row)
    lines = []
    for call_rows in by_call.values():
        ranks = ", ".join(str(r[_GRANK + 1]) for r in call_rows)
        globals_ = ", ".join(str(r[_GRANK]) for r in call_rows)
        noun = "rank" if len(call_rows) == 1 else "ranks"
        lines.append(f"  axis {noun} {ranks} (global {noun} {globals_}): {_describe(call_rows[0])}")
    raise ValueError(
        f"{op} (pshard debug mode): the {size} ranks of axis {label!r} issued different "
        f"collectives (this is axis rank {me}):\n"
        + "\n".join(lines)
        + "\nEvery rank of an axis must call the same collectives in the same order, with the "
        "same shapes, dtypes and arguments; without debug mode this would hang or combine "
        "unrelated tensors."
    )


def _exchange(
    op: str, group: dist.ProcessGroup, label: str, fp: list[int], size: int, me: int
) -> list[list[int]]:
    """Every rank's fingerprint, through the store (see the module docs)."""
    store = default_store()
    name = group_key(group)
    sequences = _sequences()
    seq = sequences.get(name, 0)
    sequences[name] = seq + 1
    prefix = f"pshard_debug/{name}/{seq}/"
    keys = [f"{prefix}{r}" for r in range(size)]
    store.set(keys[me], ",".join(map(str, fp)))
    timeout = _timeout()
    wait = CheckWait(op, label, group, name, seq, time.monotonic() + timeout)  # see waiting()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store's timeout error (its type differs between torch versions)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            raise
        ranks = [dist.get_global_rank(group, r) for r in missing]
        noun = "rank" if len(missing) == 1 else "ranks"
        if isinstance(exc, Stuck):  # in-process ranks: it can never come, known at once
            why = (
                f"and cannot anymore (this is axis rank {me}): it skipped it, or debug mode is "
                f"off on that rank (turn it on in every rank). Where the ranks are:\n"
                + "\n".join(line for line in str(exc).splitlines() if line.startswith("  "))
            )
        else:
            why = (
                f"within {timeout:g} s (this is axis rank {me}): it skipped it, is still "
                f"computing, or debug mode is off on that rank (turn it on in every rank, "
                f"PSHARD_DEBUG=1; PSHARD_DEBUG_TIMEOUT sets the wait)"
            )
        raise ValueError(
            f"{op} (pshard debug mode): axis {noun} {', '.join(map(str, missing))} (global "
            f"{noun} {', '.join(map(str, ranks))}) of axis {label!r} did not reach this "
            f"collective {why}"
        ) from None
    del wait  # no longer waiting
    rows = [[int(v) for v in store.get(key).decode().split(",")] for key in keys]
    if seq:  # every rank has read the previous round: drop our key of it
        try:
            store.delete_key(f"pshard_debug/{name}/{seq - 1}/{me}")
        except Exception:  # pragma: no cover - stores without deletion keep it
            pass
    return rows

"""Debug mode: run-time checks that every rank issues the same collective.

Debug mode is on when ``PSHARD_DEBUG`` is set to anything but ``""``, ``"0"``, ``"false"`` or
``"off"``, unless :func:`debug` says otherwise for the current context. The switch lives in a
context variable, so it is private to each thread and task and is restored on exit from
``with ps.debug(...)``.

With it on, before each collective the ranks of its group exchange a fixed-size fingerprint
(operation, axis, shape, dtype and the operation's arguments) with one all-gather of a small
integer tensor, and a mismatch raises :class:`ValueError` on every rank, naming every rank's
call, instead of hanging or silently combining unrelated tensors.
"""

from __future__ import annotations

import contextvars
import os
import zlib
from types import TracebackType

import torch
import torch.distributed as dist

__all__ = ["debug", "debug_enabled", "check_collective"]

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
    equal across ranks, specs agreeing with shapes). Each check costs one small all-gather per
    collective, so leave debug mode off in production runs.

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
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
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
    fp[2] = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
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


_PARAM_NAMES = {
    "all_gather": ("dim", "tiled"),
    "psum_scatter": ("dim", "tiled"),
    "all_to_all": ("split_dim", "concat_dim"),
    "ppermute": ("perm_code",),
    "broadcast": ("src",),
    "reduce": ("dst",),
}


def _describe(fp: list[int]) -> str:
    if fp[0] != _MAGIC or not 0 <= fp[1] < len(_OPS):
        return "<not a pshard collective>"
    op = _OPS[fp[1]]
    dtype = _DTYPES[fp[2]] if fp[2] < len(_DTYPES) else "other"
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


def check_collective(
    op: str,
    group: dist.ProcessGroup,
    label: str,
    tensor: torch.Tensor,
    params: tuple[int, ...] = (),
) -> None:
    """Compare this rank's collective call with every other rank's in ``group``.

    Raises:
        ValueError: on every rank, when any two ranks disagree on the operation, axis, shape,
            dtype or arguments; the message lists each rank's call.
    """
    size = dist.get_world_size(group)
    mine = torch.tensor(
        _encode(op, label, tuple(tensor.shape), tensor.dtype, params),
        dtype=torch.int64,
        device=tensor.device,
    )
    mine[_GRANK + 1] = dist.get_rank(group)
    every = torch.empty(size * _LEN, dtype=torch.int64, device=tensor.device)
    _all_gather_flat(every, mine, group)
    rows = every.view(size, _LEN).tolist()
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
    me = dist.get_rank(group)
    raise ValueError(
        f"{op} (pshard debug mode): the {size} ranks of axis {label!r} issued different "
        f"collectives (this is axis rank {me}):\n"
        + "\n".join(lines)
        + "\nEvery rank of an axis must call the same collectives in the same order, with the "
        "same shapes, dtypes and arguments; without debug mode this would hang or combine "
        "unrelated tensors."
    )


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)

"""Argument checks shared by every module: ints, tensor dims and mesh-axis names, with errors
naming the function and the argument; and how a function is named in messages."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WIRE_DTYPES", "axis_names", "check_int", "fn_name", "normalize_dim"]

# The dtypes pshard's wire formats (debug fingerprints, batch descriptors, shape checks) encode
# by their index here: one table, so every rank and every format agrees. Append only.
WIRE_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip


def check_int(fn: str, name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int; ``bool`` and non-integral values are a ``TypeError``, values below
    ``minimum`` a ``ValueError``, both naming ``fn`` and ``name``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{fn}: {name} must be an int, got {value!r} ({type(value).__name__})")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {v}")
    return v


def normalize_dim(
    fn: str,
    name: str,
    dim: Any,
    x: torch.Tensor,
    *,
    what: str | Callable[[], str] = "x",
    extra: int = 0,
) -> int:
    """``dim`` of ``x`` in ``[0, x.dim() + extra)`` (``extra=1``: a new dim may be inserted at the
    end); out of range is a ``ValueError`` naming ``what`` (a string, or a function giving one,
    for paths that are costly to build), its shape and the valid range."""
    d = check_int(fn, name, dim)
    n = x.dim() + extra
    if not -n <= d < n:
        label = what() if callable(what) else what
        raise ValueError(
            f"{fn}: {name}={d} is out of range for {label} with {x.dim()} dims "
            f"(shape {tuple(x.shape)}); use {name} in [{-n}, {n - 1}]"
        )
    return d % n


# transforms whose axis is named (a ProcessGroup is not accepted there)
_NAME_ONLY = ("shard_map_seq", "sequence_parallel")


def fn_name(fn: Any) -> str:
    """How a function is named in messages (``loss``, ``partial(loss)``, a class name)."""
    if isinstance(fn, functools.partial):
        return f"partial({fn_name(fn.func)})"
    return getattr(fn, "__name__", None) or type(fn).__name__


def axis_names(
    value: Any, fn: str, *, arg: str = "axis", collection: bool = False
) -> tuple[str, ...]:
    """``value`` (a mesh-axis name, or a tuple of names; any collection of names with
    ``collection``) as a non-empty tuple of names, else a ``TypeError`` naming ``fn`` and
    ``arg``."""
    if isinstance(value, str):
        names: Any = (value,)
    elif isinstance(value, (tuple, list)) or (collection and isinstance(value, (set, frozenset))):
        names = tuple(value)
    else:
        names = ()
    if not names or not all(isinstance(n, str) for n in names):
        if collection:
            options = "a mesh-axis name or a collection of names"
        elif arg == "axis" and fn not in _NAME_ONLY:
            options = "a mesh-axis name, a tuple of names or a ProcessGroup"
        else:
            options = "a mesh-axis name or a tuple of names"
        raise TypeError(f"{fn}: {arg} must be {options}, got {value!r}")
    return names

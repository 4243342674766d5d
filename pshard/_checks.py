"""Argument checks shared by every module: ints and tensor dims, with errors naming the function
and the argument."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch


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

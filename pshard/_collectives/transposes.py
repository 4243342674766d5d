"""Each collective's transpose and batching rule, written once for the eager Functions
(:mod:`pshard._collectives.rules`) and the compiled ops (:mod:`pshard._collectives.compiled`).

A collective is named by a string and its parameters by a tuple (after ``x`` and the axis):

============== ====================== ==================================================
name           parameters             transpose
============== ====================== ==================================================
psum           ()                     psum
all_gather     (dim, tiled)           psum_scatter (dim, tiled)
psum_scatter   (dim, tiled)           all_gather (dim, tiled)
all_to_all     (split_dim, concat)    all_to_all (concat, split_dim)
ppermute       (perm,)                ppermute (the inverse permutation)
broadcast      (src,)                 reduce (src,): the sum to ``src``, zeros elsewhere
reduce         (dst,)                 broadcast (dst,)
============== ====================== ==================================================

``pmax`` / ``pmin`` are not linear: their rules (the cotangent to the ranks holding the
extreme, split between ties) are written beside each form.
"""

from __future__ import annotations

from typing import Any

from .._runtime.ops import decode, encode

__all__ = ["LINEAR", "batched", "decode", "encode", "transpose"]

#: The linear collectives: each one's derivative is itself, its transpose another of them.
LINEAR = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute", "broadcast", "reduce")

_TRANSPOSED = {
    "psum": "psum",
    "all_gather": "psum_scatter",
    "psum_scatter": "all_gather",
    "all_to_all": "all_to_all",
    "ppermute": "ppermute",
    "broadcast": "reduce",
    "reduce": "broadcast",
}


def transpose(name: str, params: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """The collective (and its parameters) that is the transpose of ``name(params)``.

    Example:
        >>> from pshard._collectives.transposes import transpose
        >>> transpose("all_to_all", (1, 2))
        ('all_to_all', (2, 1))
        >>> transpose("ppermute", (((0, 1), (1, 0)),))
        ('ppermute', (((1, 0), (0, 1)),))
    """
    if name == "all_to_all":
        split_dim, concat_dim = params
        return name, (concat_dim, split_dim)
    if name == "ppermute":
        (perm,) = params
        return name, (tuple((dst, src) for src, dst in perm),)
    return _TRANSPOSED[name], params


def batched(name: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
    """``params`` for the same collective on a tensor with a batch dim inserted at the front."""
    if name in ("all_gather", "psum_scatter"):
        dim, tiled = params
        return dim + 1, tiled
    if name == "all_to_all":
        split_dim, concat_dim = params
        return split_dim + 1, concat_dim + 1
    return params

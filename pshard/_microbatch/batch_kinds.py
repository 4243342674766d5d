"""How a traced value depends on the batch: the lattice batch-dim analysis propagates.

Every tensor of a trace gets a :class:`Kind` (none: it does not depend on the batch). With
``B`` the batch size (a symbol in the trace) and ``p`` an integer power:

- ``const``: the same for every batch, times ``B**p`` (``p = 0``: independent);
  ``p = None``: some other function of ``B`` (``B + 1``);
- ``row``: per-example values along a dim of size ``B`` (rows independent of each other),
  times ``B**p``: concatenating microbatches gives the whole batch's only when ``p == 0``;
- ``sum`` / ``max`` / ``min``: a reduction over the batch of per-example values, times
  ``B**p`` (``sum`` with ``p == -1`` is a mean);
- ``inv``: ``B**p`` divided by a batch sum (``1 / token_count``);
- ``rowratio``: per-example values divided by a batch sum (a token mean's per-token terms);
- ``ratio``: a batch sum divided by another batch sum (a mean over tokens, not rows);
- ``pos``: each example's position in the batch (``arange(B)``), which differs from microbatch
  to microbatch: only reading a per-example value by it (``x[arange(B), ...]``, a padding mask
  read by example index) gives something a merge reproduces;
- ``mixed``: anything else (the square of a mean, a row minus the batch mean, the first row).

An output then merges over microbatches exactly when it is ``const`` with ``p`` 0
(``Replicate``) or 1 (``Partial("sum")``), ``row`` with ``p == 0`` (``Shard``), ``sum`` with
``p`` 0 or -1 (``Partial("sum" | "mean")``), ``max``/``min`` with ``p == 0``, or ``ratio``
(``Partial("mean")`` weighted by the denominators: only with ``weight_fn``). Everything else is
refused. The arithmetic of kinds is here (:func:`mul_kinds`, :func:`div_kinds`,
:func:`add_kinds`, :func:`pointwise_kind`, :func:`join`); the rules that give each aten op's output
its kind are in :mod:`pshard._microbatch.kind_rules`.

Pure: no process group, no tensors made. Used by :mod:`pshard._microbatch.kind_rules` and
:mod:`pshard._microbatch.batch_dim`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "CONST",
    "MIXED",
    "POS",
    "Kind",
    "add_kinds",
    "add_powers",
    "describe_kind",
    "div_kinds",
    "join",
    "mul_kinds",
    "pointwise_kind",
]


class Kind(NamedTuple):
    """How a value depends on the batch: ``kind`` (see the module docstring) times ``B**p``."""

    kind: str
    p: int | None = 0


CONST = Kind("const", 0)
MIXED = Kind("mixed", None)
POS = Kind("pos", 0)


def describe_kind(k: Kind | None) -> str:
    """A phrase for error messages."""
    if k is None or k == CONST:
        return "independent of the batch"
    p = "" if not k.p else f" times B**{k.p}"
    return {
        "const": f"a function of the batch size B{p}" if k.p is not None else "a function of B",
        "row": f"per-example values{p}",
        "sum": f"a sum over the batch{p}",
        "max": f"a max over the batch{p}",
        "min": f"a min over the batch{p}",
        "inv": "divided by a sum over the batch",
        "rowratio": "per-example values divided by a sum over the batch",
        "ratio": "a ratio of two sums over the batch (a mean over tokens, say)",
        "pos": "each example's position in the batch (arange over the batch size)",
        "mixed": "a mix of the batch that no merge of microbatches reproduces",
    }[k.kind]


def add_powers(a: int | None, b: int | None, sign: int = 1) -> int | None:
    """``a + sign * b`` for powers of ``B`` (``None``: not a power of ``B``)."""
    return None if a is None or b is None else a + sign * b


def join(a: Kind | None, b: Kind | None) -> Kind | None:
    """The kind of a buffer holding values of both kinds (a partial in-place write)."""
    a, b = a or CONST, b or CONST
    if a == CONST:
        return None if b == CONST else b
    if b == CONST or a == b:
        return a
    return MIXED


def mul_kinds(a: Kind, b: Kind, sign_b: int | None) -> Kind:
    """``a * b`` for kinds (``sign_b``: the sign of ``b`` when it is a known number)."""
    if a.kind == "const" and b.kind != "const":
        return mul_kinds(b, a, None)
    if b.kind == "const":
        p = add_powers(a.p, b.p)
        if a.kind == "const" or (a.kind in ("row", "sum", "inv") and b.p is not None):
            return Kind(a.kind, p)
        if a.kind in ("max", "min") and b.p is not None and sign_b is not None:
            return Kind(a.kind if sign_b > 0 else {"max": "min", "min": "max"}[a.kind], p)
        if a.kind in ("ratio", "rowratio") and b.p == 0:
            return a
        return MIXED
    pair = {a.kind, b.kind}
    if pair == {"row"}:
        return Kind("row", add_powers(a.p, b.p))
    if pair == {"row", "rowratio"} and Kind("row", 0) in (a, b):
        return Kind("rowratio", 0)
    if pair == {"row", "inv"} and add_powers(a.p, b.p) == 0:
        return Kind("rowratio", 0)
    if pair == {"sum", "inv"} and add_powers(a.p, b.p) == 0:
        return Kind("ratio", 0)
    return MIXED


def _inverse(b: Kind) -> Kind:
    if b.kind == "const":
        return Kind("const", None if b.p is None else -b.p)
    if b.kind == "sum":
        return Kind("inv", None if b.p is None else -b.p)
    if b.kind == "inv":
        return Kind("sum", None if b.p is None else -b.p)
    return MIXED


def div_kinds(a: Kind, b: Kind, sign_b: int | None) -> Kind:
    if a.kind == "row" and b.kind == "row":
        return Kind("row", add_powers(a.p, b.p, -1))
    if a.kind == "sum" and b.kind == "sum" and a.p == b.p and a.p is not None:
        return Kind("ratio", 0)
    if a.kind == "row" and b.kind == "sum" and a.p == b.p and a.p is not None:
        return Kind("rowratio", 0)
    return mul_kinds(a, _inverse(b), sign_b)


def add_kinds(a: Kind, b: Kind) -> Kind:
    """``a + b`` (and ``a - b``)."""
    if a == b:
        return a if a.p is not None else MIXED
    if a.kind == "const" and b.kind != "const":
        a, b = b, a
    if b.kind == "const":
        if a.kind == "const":
            return Kind("const", a.p if b.p == a.p else None)
        if b.p != 0:
            return MIXED
        if (a.kind == "row" and a.p == 0) or (a.kind == "sum" and a.p == -1):
            return a  # a per-example shift, or a mean plus a constant
        if a.kind in ("max", "min") and a.p == 0 or a.kind == "ratio":
            return a
        return MIXED
    return MIXED


def pointwise_kind(kinds: Sequence[Kind]) -> Kind:
    """A pointwise function of several values that is not known to be linear."""
    batch = [k for k in kinds if k != CONST]
    if not batch:
        return CONST
    if all(k.kind == "const" for k in batch):
        return Kind("const", None)
    if all(k.kind == "const" or (k.kind == "row" and k.p == 0) for k in batch):
        if all(k.kind == "row" or k.p == 0 for k in batch):
            return Kind("row", 0)
    return MIXED

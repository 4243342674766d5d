"""The rules of a layout: which global indices of each tensor dim a mesh coordinate holds, and
the checks of the arguments every layout function takes.

The rules are DTensor's (torch 2.13):

- placements are applied left to right, mesh dim 0 first, each acting on what the previous ones
  left of a tensor dim;
- ``Shard(d)`` splits like ``torch.chunk``: chunks of ``ceil(n / size)`` elements, so trailing
  chunks may be short or empty;
- ``StridedShard(d, split_factor=k)`` first cuts the dim into ``k`` pieces (``torch.chunk``), cuts
  each piece into ``size`` chunks, and gives chunk ``i`` of every piece to coordinate ``i``;
- ``Replicate()`` and ``Partial()`` leave every dim whole.

Internal interface (used by :mod:`pshard._core.layout` and the ``shard_map`` boundary):

- ``Runs``: the indices a block holds on one dim, as maximal ascending runs (``range``, step 1).
- ``index_runs(shape, mesh_shape, coord, placements) -> tuple[Runs, ...]``: those runs for every
  tensor dim, from checked arguments (placements with non-negative dims).
- ``check_ints(fn, name, value, *, minimum)``, ``check_mesh_shape(fn, mesh_shape)``,
  ``check_coordinate(fn, coordinate, mesh_shape)``, ``check_placements(fn, placements,
  mesh_shape, ndim, what="")`` (normalises negative dims when ``ndim`` is given),
  ``check_partials(fn, placements)``: each argument checked and returned as a tuple, errors
  naming the function ``fn``, the argument and a fix.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .placements import P, Partial, Placement, Shard, StridedShard

__all__ = [
    "Runs",
    "check_coordinate",
    "check_ints",
    "check_mesh_shape",
    "check_partials",
    "check_placements",
    "index_runs",
]

Runs = tuple[range, ...]


# ----------------------------------------------------------------------------- validation


def check_ints(fn: str, name: str, value: Any, *, minimum: int | None) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{fn}: {name} must be a sequence of ints, got {value!r}")
    out = []
    for i, v in enumerate(value):
        try:
            if isinstance(v, bool):
                raise TypeError
            v = operator.index(v)
        except TypeError:
            raise TypeError(
                f"{fn}: {name}[{i}] must be an int, got {v!r} ({type(v).__name__})"
            ) from None
        if minimum is not None and v < minimum:
            raise ValueError(f"{fn}: {name}[{i}] must be >= {minimum}, got {v} ({name} {value!r})")
        out.append(v)
    return tuple(out)


def check_mesh_shape(fn: str, mesh_shape: Any) -> tuple[int, ...]:
    return check_ints(fn, "mesh_shape", mesh_shape, minimum=1)


def check_coordinate(fn: str, coordinate: Any, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = check_ints(fn, "coordinate", coordinate, minimum=None)
    if len(coord) != len(mesh_shape):
        raise ValueError(
            f"{fn}: coordinate {coord} has {len(coord)} entries but mesh_shape {mesh_shape} "
            f"has {len(mesh_shape)} dims; give one index per mesh dim"
        )
    for i, (c, n) in enumerate(zip(coord, mesh_shape, strict=True)):
        if not 0 <= c < n:
            raise ValueError(
                f"{fn}: coordinate {coord} is outside mesh_shape {mesh_shape}: "
                f"coordinate[{i}] = {c} must be in [0, {n})"
            )
    return coord


def check_placements(
    fn: str, placements: Any, mesh_shape: tuple[int, ...], ndim: int | None, what: str = ""
) -> tuple[Placement, ...]:
    """Check ``placements`` (one per mesh dim); with ``ndim``, normalise and range-check dims."""
    if isinstance(placements, P):
        raise TypeError(
            f"{fn}: placements is {placements!r}, a PartitionSpec (one entry per tensor dim); "
            f"this function takes one placement per mesh dim, e.g. (Shard(0), Replicate())"
        )
    if isinstance(placements, Placement):
        raise TypeError(
            f"{fn}: placements must be a sequence with one placement per mesh dim, got the "
            f"single placement {placements!r}; wrap it: ({placements!r},)"
        )
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        raise TypeError(
            f"{fn}: placements must be a sequence with one placement per mesh dim, "
            f"got {placements!r} ({type(placements).__name__})"
        )
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            hint = (
                "; convert torch placements with ps.from_torch_placement"
                if type(p).__module__.startswith("torch")
                else ""
            )
            raise TypeError(
                f"{fn}: placements[{i}] must be Shard, StridedShard, Replicate or Partial, "
                f"got {p!r} ({type(p).__name__}){hint}"
            )
        if ndim is not None and isinstance(p, (Shard, StridedShard)):
            if not -ndim <= p.dim < ndim:
                if ndim == 0:
                    fix = "a 0-d tensor can only be Replicate() or Partial()"
                else:
                    fix = f"use a dim in [{-ndim}, {ndim - 1}]"
                raise ValueError(
                    f"{fn}: placements[{i}] = {p!r} but the tensor has {ndim} dims ({what}); {fix}"
                )
            if p.dim < 0:
                p = (
                    StridedShard(p.dim + ndim, p.split_factor)
                    if isinstance(p, StridedShard)
                    else Shard(p.dim + ndim)
                )
        out.append(p)
    if len(out) != len(mesh_shape):
        raise ValueError(
            f"{fn}: placements {tuple(out)} has {len(out)} entries but mesh_shape {mesh_shape} "
            f"has {len(mesh_shape)} dims; give one placement per mesh dim "
            f"(Replicate() for a mesh dim that does not split the tensor)"
        )
    return tuple(out)


def check_partials(fn: str, placements: tuple[Placement, ...]) -> None:
    reduces = {p.reduce for p in placements if isinstance(p, Partial)}
    if len(reduces) > 1:
        raise ValueError(
            f"{fn}: placements {placements} mix Partial reductions {sorted(reduces)}; "
            f"the blocks' reduction order would be ambiguous, use one reduction for every mesh dim"
        )


# ----------------------------------------------------------------------------- core


def _chunk(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Bounds of chunk ``index`` when ``torch.chunk`` cuts ``length`` into ``num_chunks``."""
    size = -(-length // num_chunks)
    return min(index * size, length), min((index + 1) * size, length)


def _spans(p: Placement, length: int, num_chunks: int, index: int) -> list[tuple[int, int]]:
    """Position intervals (ascending, disjoint) that coordinate ``index`` keeps of ``length``."""
    if isinstance(p, StridedShard):
        spans = []
        for piece in range(p.split_factor):
            start, stop = _chunk(length, p.split_factor, piece)
            lo, hi = _chunk(stop - start, num_chunks, index)
            if hi > lo:
                spans.append((start + lo, start + hi))
        return spans
    lo, hi = _chunk(length, num_chunks, index)
    return [(lo, hi)] if hi > lo else []


def _take(runs: Runs, spans: list[tuple[int, int]]) -> Runs:
    """The elements at positions ``spans`` of the concatenation of ``runs``, as maximal runs."""
    out: list[range] = []
    k, base = 0, 0  # runs[k] covers positions [base, base + len(runs[k]))
    for lo, hi in spans:
        while lo < hi:
            while base + len(runs[k]) <= lo:
                base += len(runs[k])
                k += 1
            run = runs[k]
            stop = min(hi, base + len(run))
            piece = range(run.start + lo - base, run.start + stop - base)
            if out and out[-1].stop == piece.start:
                out[-1] = range(out[-1].start, piece.stop)
            else:
                out.append(piece)
            lo = stop
    return tuple(out)


def index_runs(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[Runs, ...]:
    """The global indices the block at ``coord`` holds on each dim of a tensor of ``shape``, as
    maximal runs (``()`` for an empty block); the arguments are checked already, every
    placement's dim non-negative."""
    runs: list[Runs] = [(range(n),) if n else () for n in shape]
    for p, n, c in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(p, (Shard, StridedShard)):
            length = sum(map(len, runs[p.dim]))
            runs[p.dim] = _take(runs[p.dim], _spans(p, length, n, c))
    return tuple(runs)

"""The boundary of a map: moving values between "outside" (one whole value, replicated over the
mapped mesh axes) and "inside" (each rank's block), differentiably.

Three ``torch.autograd.Function`` classes, each with ``backward``, ``jvp`` and ``vmap`` rules
that call the boundary Functions again (never a bare collective), so ``torch.func`` transforms of
any order compose with them:

- :class:`ToBlock` ``(x, layout, scale, check)``: this rank's block of a replicated value, times
  ``scale`` (no communication). Transpose: :class:`FromBlocks` with ``reduce=True``.
- :class:`FromBlocks` ``(y, layout, reduce, scale, whole, check)``: the whole value from every
  rank's block, all-gathered over the axes that split it (uneven blocks are padded to the largest
  and trimmed; the block sizes are exchanged first when the whole shape ``whole`` is unknown).
  Over the mapped axes that do not split it the value is either this rank's copy
  (``reduce=False``: an output claimed to be replicated) or the sum of the copies
  (``reduce=True``: a ``Partial("sum")`` output, or the transpose of :class:`ToBlock`); then
  times ``scale``. Transpose: :class:`ToBlock` with the same ``scale`` (``reduce=True``) or
  ``scale / size`` of the replicated axes (``reduce=False``: JAX's ``check_vma=False`` rule:
  outside cotangents are replicated, so each copy gets an equal share).
- :class:`PartialExtreme` ``(y, layout, op)``: ``Partial("max" | "min")``, an all-reduce whose
  transpose gives the replicated cotangent to the ranks holding the extreme, split between ties.

The convention (JAX's): outside the map, values *and cotangents* are replicated over the mapped
axes, so the transposes above need no communication on the way in and make the gradient of a
mapped function equal the single-process gradient on every rank.

A :class:`BlockLayout` says how one leaf is split: DTensor placements applied in order over the
mesh axes that split it (uneven sizes follow ``torch.chunk``; the block of a coordinate is the
one :func:`pshard.local_indices` names), the process groups involved, and the leaf's key path
for error messages.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from typing import Any

import torch
import torch.distributed as dist

from .._compat import assert_in_program, storage_key
from .._core.caches import cached
from .._core.checks import WIRE_DTYPES
from .._core.layout_rules import index_runs
from .._core.placements import Shard, StridedShard
from .._runtime.tracing import active_trace, outside_trace
from .._runtime.wire import Comm, all_gather, all_reduce

__all__ = [
    "BlockLayout",
    "ToBlock",
    "FromBlocks",
    "PartialExtreme",
    "check_replicated",
    "exchange_shapes",
    "shape_row",
    "whole_shape",
]

_SHAPE_WIDTH = 16  # fixed width of the shape exchange, so ranks disagreeing on ndim are caught


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How one leaf is laid out over the mapped axes.

    Attributes:
        shards: ``Shard``/``StridedShard`` placements (non-negative dims) in the order they
            apply, one per mesh axis of size > 1 that splits the leaf.
        sizes: the size of the mesh axis each of ``shards`` applies over.
        coord: this rank's index on each of those axes.
        perm: the position of each of those axes in mesh order (the order of ``gather``'s ranks).
        gather: the axes that split the leaf, in mesh order; ``None`` when none does.
        rep: the mapped axes that do not split the leaf; ``None`` when their size is 1.
        label: the leaf's key path (``in_specs[0]['x']``) and spec, for error messages.
        fn: the function the errors name (``shard_map``, ``from_local``, ...).
        back_check: debug mode's check that the cotangent a gather receives is the same on
            every rank of a group (an axis group and the message), or ``None``.
    """

    shards: tuple[Shard | StridedShard, ...] = ()
    sizes: tuple[int, ...] = ()
    coord: tuple[int, ...] = ()
    perm: tuple[int, ...] = ()
    gather: Comm | None = None
    rep: Comm | None = None
    label: str = ""
    fn: str = "shard_map"
    back_check: tuple[Comm, str] | None = None

    @property
    def rep_size(self) -> int:
        return 1 if self.rep is None else self.rep.size

    def shifted(self) -> BlockLayout:
        """The layout of the same leaf with a batch dim inserted at the front (for vmap)."""
        shards = tuple(dataclasses.replace(p, dim=p.dim + 1) for p in self.shards)
        return dataclasses.replace(self, shards=shards)


# --- layout plans (pure) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to assemble a leaf of ``global_shape`` from the gathered, padded blocks."""

    local: tuple[tuple[int, ...], ...]  # each gather rank's block shape
    pad: tuple[int, ...]  # the largest block on every dim: what each rank sends
    order: tuple[int, ...]  # permutation of (mesh axes..., tensor dims...) grouping each dim's axes
    merged: tuple[int, ...]  # shape after merging each dim with its axes
    takes: tuple[tuple[range, ...] | None, ...]  # per dim: merged positions, in global order


def _mesh_sizes(sizes: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(sizes)
    for size, j in zip(sizes, perm, strict=True):
        out[j] = size
    return tuple(out)


@cached("layout plans of map boundaries", 1024)
def _plan(
    shards: tuple[Shard | StridedShard, ...],
    sizes: tuple[int, ...],
    perm: tuple[int, ...],
    global_shape: tuple[int, ...],
) -> _Plan:
    msizes = _mesh_sizes(sizes, perm)
    coords = list(itertools.product(*map(range, msizes)))  # gather rank order (mesh order)

    def runs(mcoord: tuple[int, ...]) -> tuple[tuple[range, ...], ...]:
        return index_runs(global_shape, sizes, tuple(mcoord[j] for j in perm), shards)

    local = tuple(tuple(sum(map(len, r)) for r in runs(c)) for c in coords)
    pad = tuple(max(shape[d] for shape in local) for d in range(len(global_shape)))
    k = len(msizes)
    by_dim: list[list[int]] = [[] for _ in global_shape]
    for p, j in zip(shards, perm, strict=True):
        by_dim[p.dim].append(j)
    order: list[int] = []
    merged: list[int] = []
    takes: list[tuple[range, ...] | None] = []
    for d, axes in enumerate(by_dim):
        axes.sort()
        order.extend([*axes, k + d])
        width = math.prod(msizes[j] for j in axes) * pad[d]
        merged.append(width)
        if not axes:  # whole on every rank
            takes.append(None)
            continue
        # merged position of global index g: flat(coordinate on `axes`) * pad[d] + position
        # within that coordinate's block
        where: list[tuple[int, range]] = []  # (global start, merged positions)
        for flat, sub in enumerate(itertools.product(*(range(msizes[j]) for j in axes))):
            mcoord = [0] * k
            for j, c in zip(axes, sub, strict=True):
                mcoord[j] = c
            pos = flat * pad[d]
            for r in runs(tuple(mcoord))[d]:
                where.append((r.start, range(pos, pos + len(r))))
                pos += len(r)
        where.sort(key=lambda item: item[0])
        pieces: list[range] = []
        for _, r in where:
            if pieces and pieces[-1].stop == r.start:
                pieces[-1] = range(pieces[-1].start, r.stop)
            else:
                pieces.append(r)
        identity = len(pieces) == 1 and pieces[0] == range(width)
        takes.append(None if identity or not pieces and width == 0 else tuple(pieces))
    return _Plan(local, pad, tuple(order), tuple(merged), tuple(takes))


def _take(x: torch.Tensor, dim: int, pieces: tuple[range, ...]) -> torch.Tensor:
    if len(pieces) == 1:
        return x.narrow(dim, pieces[0].start, len(pieces[0]))
    if not pieces:
        return x.narrow(dim, 0, 0)
    index = torch.cat([torch.arange(r.start, r.stop, device=x.device) for r in pieces])
    return x.index_select(dim, index)


# --- raw operations (plain tensors, no autograd) ----------------------------------------------


def _slice(x: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """This rank's block of the whole value ``x`` (a new tensor, never a view of ``x``)."""
    out = x
    for d, runs in enumerate(index_runs(tuple(x.shape), lay.sizes, lay.coord, lay.shards)):
        if len(runs) == 1 and len(runs[0]) == x.shape[d]:
            continue
        out = _take(out, d, runs)
    if storage_key(out) == storage_key(x):
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def exchange_shapes(y: torch.Tensor, lay: BlockLayout) -> tuple[int, ...]:
    """Every rank's block shape (over ``lay.gather``); returns the whole shape, after checking
    that the blocks are those of the layout."""
    c = lay.gather
    assert c is not None
    with outside_trace():  # metadata: exchanged when a program is made, not in it
        rows = [tuple(r) for r in all_gather(shape_row(y), c, 0, False).tolist()]
    return whole_shape(rows, lay)


def shape_row(y: torch.Tensor) -> torch.Tensor:
    """``y``'s shape as a fixed-width row for :func:`whole_shape` (``[ndim, *shape, -1...]``)."""
    width = 1 + max(_SHAPE_WIDTH, y.dim())
    row = torch.full((width,), -1, dtype=torch.int64, device=y.device)
    row[0] = y.dim()
    row[1 : 1 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
    return row


def whole_shape(rows: list[tuple[int, ...]], lay: BlockLayout) -> tuple[int, ...]:
    """The whole shape from the :func:`shape_row` of every rank of ``lay.gather`` (in the
    group's order), after checking that the blocks are those of the layout."""
    c = lay.gather
    assert c is not None
    ndims = sorted({r[0] for r in rows})
    axes = tuple(c.name.split(","))
    if len(ndims) > 1:
        shapes_text = ", ".join(f"rank {i}: {_shape_text(r)}" for i, r in enumerate(rows))
        raise ValueError(
            f"{lay.fn} {lay.label}: the ranks of axes {axes} returned blocks with different "
            f"numbers of dims ({shapes_text}); every rank must return the same kind of value"
        )
    shapes = [r[1 : 1 + ndims[0]] for r in rows]
    msizes = _mesh_sizes(lay.sizes, lay.perm)
    split_dims = {p.dim for p in lay.shards}
    axes_of = {
        d: [j for p, j in zip(lay.shards, lay.perm, strict=True) if p.dim == d] for d in split_dims
    }
    whole = []
    for d in range(ndims[0]):
        if d not in split_dims:
            whole.append(shapes[0][d])
            continue
        # the coordinates that vary only along the axes splitting dim d
        total = 0
        for flat, coord in enumerate(itertools.product(*map(range, msizes))):
            if all(coord[j] == 0 for j in range(len(msizes)) if j not in axes_of[d]):
                total += shapes[flat][d]
        whole.append(total)
    plan = _plan(lay.shards, lay.sizes, lay.perm, tuple(whole))
    if [tuple(s) for s in shapes] != list(plan.local):
        got = ", ".join(f"rank {i}: {tuple(s)}" for i, s in enumerate(shapes))
        want = ", ".join(f"rank {i}: {s}" for i, s in enumerate(plan.local))
        raise ValueError(
            f"{lay.fn} {lay.label}: the blocks returned on the ranks of axes {axes} have "
            f"shapes ({got}), which is not how the spec splits a tensor of shape {tuple(whole)} "
            f"(torch.chunk sizes: {want}); return blocks of those sizes, or give this output a "
            f"spec that does not split the mismatching dims"
        )
    return tuple(whole)


def _shape_text(row: tuple[int, ...]) -> str:
    return str(tuple(row[1 : 1 + row[0]]))


def _assemble(y: torch.Tensor, lay: BlockLayout, whole: tuple[int, ...] | None) -> torch.Tensor:
    """The whole value from every rank's block ``y`` (all-gather over ``lay.gather``)."""
    c = lay.gather
    assert c is not None
    if whole is None:
        whole = exchange_shapes(y, lay)
    plan = _plan(lay.shards, lay.sizes, lay.perm, whole)
    if tuple(y.shape) != plan.pad:
        padded = y.new_zeros(plan.pad)
        padded[tuple(slice(0, n) for n in y.shape)] = y
        y = padded
    buf = all_gather(y, c, 0, False)  # (ranks, *pad), rank-major in mesh order
    msizes = _mesh_sizes(lay.sizes, lay.perm)
    out = buf.view(*msizes, *plan.pad).permute(plan.order).reshape(plan.merged)
    for d, pieces in enumerate(plan.takes):
        if pieces is not None:
            out = _take(out, d, pieces)
    return out.contiguous()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The values of ``x`` as int64, equal exactly when the values are (``-0.0 == 0.0``, and a
    NaN equals any NaN)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():
        x = torch.where(x.isnan(), torch.nan, x + 0.0)  # one NaN; -0.0 + 0.0 is 0.0
        width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()]
        x = x.contiguous().view(width)
    return x.reshape(-1).to(torch.int64)


def check_replicated(x: torch.Tensor, c: Comm, message: str) -> None:
    """Raise ``ValueError(message + which ranks differ)`` on every rank of ``c`` unless ``x`` has
    the same shape, dtype and values on all of them (a small all-gather of shapes, dtypes and
    digests, then one exact all-reduce of the values). In a traced program (``ps.jit``) shapes
    and dtypes are checked when the program is made and the values when it runs (a
    ``RuntimeError`` with ``message`` on every rank)."""
    traced = active_trace() is not None
    bits = _bits(x)
    n = bits.numel()
    with outside_trace():  # shapes and dtypes: known when a program is made, checked then
        head = torch.full((3 + max(_SHAPE_WIDTH, x.dim()),), -1, dtype=torch.int64,
                          device=x.device)  # fmt: skip
        head[0] = zlib.crc32(str(x.dtype).encode())
        head[1] = 0
        if not traced:  # wraps around; only groups ranks for the message
            weights = torch.arange(n, dtype=torch.int64, device=bits.device) * 0x9E3779B1 + 1
            head[1] = (bits * weights).sum()
        head[2] = x.dim()
        head[3 : 3 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        rows = all_gather(head, c, 0, False).tolist()

    def global_rank(r: int) -> int:
        return r if c.group is None else dist.get_global_rank(c.group, r)

    kinds = [(r[0], tuple(r[3 : 3 + r[2]])) for r in rows]
    if len(set(kinds)) > 1:
        dtypes = {zlib.crc32(str(t).encode()): str(t).removeprefix("torch.") for t in WIRE_DTYPES}
        held = ", ".join(
            f"global rank {global_rank(r)}: {shape} {dtypes.get(code, 'another dtype')}"
            for r, (code, shape) in enumerate(kinds)
        )
        raise ValueError(f"{message}; the ranks hold different shapes or dtypes ({held})")
    extremes = all_reduce(torch.cat([bits, ~bits]), c, "pmax")  # max and ~min in one reduction
    if traced:  # the values: checked when the program runs, on every rank alike
        same = (extremes[:n] == ~extremes[n:]).all()
        assert_in_program(same, f"{message}; the ranks hold different values")
        return
    if torch.equal(extremes[:n], ~extremes[n:]):
        return
    groups: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row[1], []).append(global_rank(r))
    held = " vs ".join("[" + ", ".join(map(str, g)) + "]" for g in groups.values())
    raise ValueError(f"{message}; global ranks holding equal values: {held}")


# --- autograd / torch.func rules ----------------------------------------------------------------


def _front(x: torch.Tensor, bdim: int) -> torch.Tensor:
    return x if bdim == 0 else x.movedim(bdim, 0)


class ToBlock(torch.autograd.Function):
    """``(x, lay, scale, check)`` -> this rank's block of ``x``, times ``scale``; with ``check``
    (an axis group and a message) ``x`` is first checked to be equal on all of its ranks."""

    @staticmethod
    def forward(
        x: torch.Tensor, lay: BlockLayout, scale: float, check: tuple[Comm, str] | None
    ) -> torch.Tensor:
        if check is not None:
            check_replicated(x, *check)
        out = _slice(x, lay) if lay.shards else x.view_as(x)
        return out * scale if scale != 1 else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.lay, ctx.scale = inputs[1], inputs[2]
        ctx.whole = tuple(inputs[0].shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return FromBlocks.apply(g, ctx.lay, True, ctx.scale, ctx.whole, None), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return ToBlock.apply(t, ctx.lay, ctx.scale, None)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        x: torch.Tensor,
        lay: BlockLayout,
        scale: float,
        check: tuple[Comm, str] | None,
    ) -> Any:
        if in_dims[0] is None:
            return ToBlock.apply(x, lay, scale, check), None
        return ToBlock.apply(_front(x, in_dims[0]), lay.shifted(), scale, check), 0


class FromBlocks(torch.autograd.Function):
    """``(y, lay, reduce, scale, whole, check)`` -> the whole value from every rank's block
    (``whole``: its shape when known, else exchanged), summed over ``lay.rep`` when ``reduce``
    (else this rank's copy), times ``scale``; ``check`` as in :class:`ToBlock`."""

    @staticmethod
    def forward(
        y: torch.Tensor,
        lay: BlockLayout,
        reduce: bool,
        scale: float,
        whole: tuple[int, ...] | None,
        check: tuple[Comm, str] | None,
    ) -> torch.Tensor:
        if check is not None:
            check_replicated(y, *check)
        out = y
        if reduce and lay.rep is not None:
            out = all_reduce(out, lay.rep, "psum")  # on the block: cheaper than after gathering
        if lay.gather is not None:
            out = _assemble(out, lay, whole)
        if scale != 1:
            out = out * scale
        return out.view_as(out) if out is y else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.lay, ctx.reduce, ctx.scale = inputs[1], inputs[2], inputs[3]
        ctx.whole = tuple(output.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        scale = ctx.scale if ctx.reduce else ctx.scale / ctx.lay.rep_size
        return ToBlock.apply(g, ctx.lay, scale, ctx.lay.back_check), None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return FromBlocks.apply(t, ctx.lay, ctx.reduce, ctx.scale, ctx.whole, None)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        y: torch.Tensor,
        lay: BlockLayout,
        reduce: bool,
        scale: float,
        whole: tuple[int, ...] | None,
        check: tuple[Comm, str] | None,
    ) -> Any:
        if in_dims[0] is None:
            return FromBlocks.apply(y, lay, reduce, scale, whole, check), None
        y = _front(y, in_dims[0])
        whole = None if whole is None else (y.shape[0], *whole)
        return FromBlocks.apply(y, lay.shifted(), reduce, scale, whole, check), 0


class PartialExtreme(torch.autograd.Function):
    """``(y, lay, op)``: the elementwise max (``op="pmax"``) or min (``"pmin"``) over
    ``lay.rep``. The (replicated) cotangent goes to the ranks holding the extreme, split evenly
    between ties; the tangent is the mean of theirs."""

    @staticmethod
    def forward(y: torch.Tensor, lay: BlockLayout, op: str) -> torch.Tensor:
        assert lay.rep is not None
        return all_reduce(y, lay.rep, op)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.lay = inputs[1]
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def _share(ctx: Any, dtype: torch.dtype) -> torch.Tensor:
        y, out = ctx.saved_tensors
        holds = (y == out).to(dtype)
        return holds / FromBlocks.apply(holds, ctx.lay, True, 1.0, None, None)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        share = PartialExtreme._share(ctx, g.dtype)
        return ToBlock.apply(g, ctx.lay, 1.0, None) * share, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        share = PartialExtreme._share(ctx, t.dtype)
        return FromBlocks.apply(t * share, ctx.lay, True, 1.0, None, None)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], y: torch.Tensor, lay: BlockLayout, op: str
    ) -> Any:
        if in_dims[0] is None:
            return PartialExtreme.apply(y, lay, op), None
        return PartialExtreme.apply(_front(y, in_dims[0]), lay, op), 0

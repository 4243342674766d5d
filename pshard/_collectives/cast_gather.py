"""FSDP's gather of a unit's parameters with a dtype policy, as one differentiable operation.

:class:`CastGather` ``(plan, slot, *blocks)``: each block cast to ``plan.param_dtype`` (so the
wire carries the compute dtype: half the bytes of float32 for bfloat16), then gathered level by
level (one mesh axis per level, the innermost split first; uneven blocks padded to the largest
piece and trimmed, ``torch.chunk``'s rule) into the whole parameter. Its transpose,
:class:`CastScatter` ``(plan, dtypes, slot, *cotangents)``: each whole cotangent cast to
``plan.reduce_dtype``, then reduce-scattered level by level (``transpose="scatter"``, inside a
map: the sum over the ranks that used the whole) or sliced (``"slice"``, a ``GlobalTensor``
outside a map, whose cotangent is replicated: this rank's block of it, no communication), then
cast to the block's own dtype. It is one operation, not a cast followed by a collective,
because autograd casts what a backward returns to its input's dtype: behind a separate cast,
the reduction would run in the compute dtype.

Rules, as for the other collectives: each Function's ``backward`` is the other one (so
``grad`` of ``grad`` works), ``jvp`` runs the same Function on the tangents (both are linear),
``vmap`` runs it on each block with the batch dim in front. Only the primal call of a unit
takes a prefetched gather or defers its scatter: the rules pass no slot, but for ``vmap`` over
other inputs, where the blocks are the primal ones.

Overlap (:class:`Slot`, given by ``sharded_call``'s schedule): a unit's gathers may have been
issued ahead (:class:`PendingGather`, from :func:`gather_start`); the forward then takes them
instead of gathering. A unit's scatter may be left in flight (:class:`PendingScatter`): the
outputs are returned before the data arrive, and the schedule waits for them before anything
reads them (a Function all the unit's blocks pass through, whose backward runs after every
unit's). Results are the same bits either way.

The gather runs inside one operator, ``pshard::cast_gather`` (the plan and the slot travel
beside it in a context variable): ``ps.checkpoint``'s tape then sees the same operator whether
the data came from a prefetch or from a gather run there, and recomputes it as one value.
While ``ps.jit`` traces, the gather runs as its collectives instead (each a node of the
program).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._core.layout_rules import index_runs
from .._core.placements import Shard, StridedShard
from .._runtime import wire
from .._runtime.streams import SideStream
from .._runtime.tracing import active_trace
from .._runtime.wire import Comm
from . import apply
from .apply import call, eager_rules

__all__ = [
    "BlockPlan",
    "CastGather",
    "CastScatter",
    "Level",
    "PendingGather",
    "PendingScatter",
    "Slot",
    "UnitPlan",
    "block_levels",
    "cast_gather",
    "gather_start",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Level:
    """One gather of a block over one mesh axis: dim ``dim`` goes from this rank's ``own``
    elements to ``length`` (every rank sends ``piece``, the largest, padded with zeros). The
    gathered pieces, rank after rank, hold the whole in order and are trimmed, or (a strided
    split) ``source[g]`` is where element ``g`` of the whole is among them and ``mine`` the
    elements this rank holds."""

    comm: Comm
    dim: int
    own: int
    piece: int
    length: int
    source: tuple[int, ...] | None = None
    mine: tuple[int, ...] | None = None

    def shifted(self) -> Level:
        return dataclasses.replace(self, dim=self.dim + 1)


def block_levels(
    whole: tuple[int, ...],
    splits: Sequence[tuple[Comm, Shard | StridedShard]],
    gathered: Sequence[bool] | None = None,
) -> tuple[tuple[int, ...], tuple[Level, ...]]:
    """This rank's block shape of a tensor of shape ``whole`` split by ``splits`` (each a
    resolved mesh axis and its placement, in the order they apply: ``torch.chunk``'s sizes),
    and the levels that gather it back, innermost first (axes of size 1 need none; nor do the
    splits whose ``gathered`` is false, which stay: they must apply first on their dim).

    Example:
        >>> from pshard._runtime.wire import Comm
        >>> from pshard._core.placements import Shard
        >>> comm = Comm(None, 4, 3, "dp", False)  # index 3 of 4
        >>> shape, (level,) = block_levels((10, 2), [(comm, Shard(0))])
        >>> shape, (level.own, level.piece, level.length)
        ((1, 2), (1, 3, 10))
    """
    sizes = tuple(c.size for c, _ in splits)
    coords = tuple(c.rank for c, _ in splits)
    places = tuple(p for _, p in splits)
    runs = index_runs(whole, sizes, coords, places)
    shape = tuple(sum(map(len, r)) for r in runs)
    levels = []
    for i in reversed(range(len(splits))):
        comm, p = splits[i]
        if comm.size == 1 or (gathered is not None and not gathered[i]):
            continue
        d = p.dim
        length = sum(map(len, index_runs(whole, sizes[:i], coords[:i], places[:i])[d]))
        one = dataclasses.replace(p, dim=0)
        held = [
            [g for run in index_runs((length,), (comm.size,), (c,), (one,))[0] for g in run]
            for c in range(comm.size)
        ]
        piece = max(map(len, held))
        source = mine = None
        if any(h != list(range(c * piece, c * piece + len(h))) for c, h in enumerate(held)):
            where = [0] * length
            for c, h in enumerate(held):
                for j, g in enumerate(h):
                    where[g] = c * piece + j
            source, mine = tuple(where), tuple(held[comm.rank])
        levels.append(Level(comm, d, len(held[comm.rank]), piece, length, source, mine))
    return shape, tuple(levels)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPlan:
    """How one block becomes its whole parameter: the ``levels`` in the order they run, the
    transpose (``"scatter"``: reduce-scatter; ``"slice"``: this rank's block of a replicated
    cotangent, with ``check`` run on it first where debug mode asks for one), and whether the
    unit's dtypes apply to it (``cast``; not to a buffer)."""

    block_shape: tuple[int, ...]
    whole_shape: tuple[int, ...]
    levels: tuple[Level, ...]
    transpose: str = "scatter"
    check: Callable[[torch.Tensor], None] | None = None
    cast: bool = True  # False: the unit's dtypes do not apply (a buffer)

    def shifted(self, n: int) -> BlockPlan:
        """The plan of the same block with a batch dim of ``n`` in front (vmap)."""
        return dataclasses.replace(
            self,
            block_shape=(n, *self.block_shape),
            whole_shape=(n, *self.whole_shape),
            levels=tuple(lv.shifted() for lv in self.levels),
            check=None,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class UnitPlan:
    """The blocks of one unit and its dtypes: ``param_dtype`` (what is gathered and computed
    with; ``None``: each block's own) and ``reduce_dtype`` (what cotangents are reduced or
    sliced in; ``None``: as they come)."""

    blocks: tuple[BlockPlan, ...]
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def one(self, i: int, n: int | None = None) -> UnitPlan:
        """The plan of block ``i`` alone (with a batch dim of ``n`` in front)."""
        block = self.blocks[i] if n is None else self.blocks[i].shifted(n)
        return dataclasses.replace(self, blocks=(block,))


class Slot(Protocol):
    """A unit's place in ``sharded_call``'s schedule, as its gather sees it."""

    def take(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The wholes of ``blocks`` gathered ahead (waited for here), or ``None``: gather now."""

    def defers(self) -> SideStream | None:
        """The stream to issue this unit's scatter on if it may be left in flight (then
        handed to :meth:`defer`), ``None`` if it must be waited for at once."""

    def defer(self, pending: PendingScatter) -> None:
        """Take ``pending`` to wait for later."""


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] >= length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


def _assemble(buf: torch.Tensor, lv: Level) -> torch.Tensor:
    """The gathered ``(size, *piece)`` buffer as the whole of ``lv.dim``."""
    out = buf.movedim(0, lv.dim).flatten(lv.dim, lv.dim + 1)
    if lv.source is None:
        return out.narrow(lv.dim, 0, lv.length)
    return out.index_select(lv.dim, torch.tensor(lv.source, device=out.device))


def _unassemble(g: torch.Tensor, lv: Level) -> torch.Tensor:
    """The transpose of :func:`_assemble`: the whole's cotangent in the ``size * piece``
    positions of the gathered buffer (zeros in the padding)."""
    if lv.source is None:
        return _pad(g, lv.dim, lv.comm.size * lv.piece)
    shape = list(g.shape)
    shape[lv.dim] = lv.comm.size * lv.piece
    index = torch.tensor(lv.source, device=g.device)
    return g.new_zeros(shape).index_copy(lv.dim, index, g)


def _gather_level(x: torch.Tensor, lv: Level) -> torch.Tensor:
    buf, pending = wire.all_gather_start(_pad(x, lv.dim, lv.piece), lv.comm)
    wire.wait(pending)
    return _assemble(buf, lv)


class PendingGather:
    """A unit's gathers in flight (the first level of each block; the others run in
    :meth:`wait`). Holds the blocks' versions at the time of issue: a block written to since
    cannot take it."""

    def __init__(
        self, plan: UnitPlan, blocks: Sequence[torch.Tensor], stream: SideStream | None = None
    ) -> None:
        self.plan = plan
        self.versions = [_version(b) for b in blocks]
        self._stream = stream
        self._blocks = list(blocks) if stream is not None and stream.active else []
        self._parts: list[tuple[torch.Tensor, list[Any]] | torch.Tensor] = []
        with contextlib.nullcontext() if stream is None else stream.issue():
            firsts: dict[int, tuple[torch.Tensor, Comm]] = {}
            for i, (bp, b) in enumerate(zip(plan.blocks, blocks, strict=True)):
                x = _cast(b, plan.param_dtype if bp.cast else None)
                if not bp.levels:
                    self._parts.append(x if x is not b else b.clone())
                    continue
                lv = bp.levels[0]
                firsts[i] = (_pad(x, lv.dim, lv.piece), lv.comm)
                self._parts.append(x)  # its gather's, below
            for i, part in _gathers_start(firsts).items():
                self._parts[i] = part

    def matches(self, blocks: Sequence[torch.Tensor]) -> bool:
        return len(blocks) == len(self.versions) and all(
            tuple(b.shape) == bp.block_shape and _version(b) == v
            for b, bp, v in zip(blocks, self.plan.blocks, self.versions, strict=True)
        )

    def wait(self) -> list[torch.Tensor]:
        made = [p if isinstance(p, torch.Tensor) else p[0] for p in self._parts]
        for part in self._parts:
            if not isinstance(part, torch.Tensor):
                wire.wait(part[1])
        if self._stream is not None:
            self._stream.join(made)
        out = []
        for bp, buf in zip(self.plan.blocks, made, strict=True):
            if not bp.levels:
                out.append(buf)
                continue
            x = _assemble(buf, bp.levels[0])
            for lv in bp.levels[1:]:
                x = _gather_level(x, lv)
            out.append(x)
        self._parts, self._blocks = [], []
        return out


def _gathers_start(
    firsts: dict[int, tuple[torch.Tensor, Comm]],
) -> dict[int, tuple[torch.Tensor, list[Any]]]:
    """Issue the all-gathers of the pieces ``firsts`` (index -> piece, axis): one each, or,
    in a program (``ps.jit``), one per axis and dtype for all the pieces of a unit (a
    program's collectives run one after the other: one exchange, not one per parameter)."""
    if active_trace() is None:
        return {i: wire.all_gather_start(x, c) for i, (x, c) in firsts.items()}
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, (x, c) in firsts.items():
        groups.setdefault((c.key, x.dtype), []).append(i)
    out: dict[int, tuple[torch.Tensor, list[Any]]] = {}
    for members in groups.values():
        c = firsts[members[0]][1]
        flat = torch.cat([firsts[i][0].reshape(-1) for i in members])
        buf, pending = wire.all_gather_start(flat, c)  # (size, total)
        start = 0
        for i in members:
            x = firsts[i][0]
            out[i] = (buf[:, start : start + x.numel()].reshape(c.size, *x.shape), pending)
            start += x.numel()
    return out


def gather_start(
    plan: UnitPlan, blocks: Sequence[torch.Tensor], stream: SideStream | None = None
) -> PendingGather:
    """Issue the gathers of ``blocks`` (plain tensors, this rank's blocks, in ``plan``'s
    order; on ``stream`` beside the compute) and return at once; the blocks must not be
    written to until it is waited for."""
    return PendingGather(plan, blocks, stream)


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or x.dtype == dtype or not x.is_floating_point():
        return x
    return x.to(dtype)


class PendingScatter:
    """A unit's transposes in flight: :attr:`outputs` are returned at once (filled by
    :meth:`wait`); only the last level of each block is left in flight."""

    def __init__(
        self,
        plan: UnitPlan,
        dtypes: Sequence[torch.dtype],
        cotangents: Sequence[torch.Tensor],
        stream: SideStream | None = None,
    ) -> None:
        self.outputs: list[torch.Tensor] = []
        self._finish: list[Callable[[], None]] = []
        self._pending: list[Any] = []
        self._stream = stream
        # read on the side stream: kept until it is joined (their memory is the compute's)
        self._held = list(cotangents) if stream is not None and stream.active else []
        with contextlib.nullcontext() if stream is None else stream.issue():
            self._issue(plan, dtypes, cotangents)

    def _issue(
        self, plan: UnitPlan, dtypes: Sequence[torch.dtype], cotangents: Sequence[torch.Tensor]
    ) -> None:
        lasts: dict[int, tuple[torch.Tensor, Level | None]] = {}
        for i, (bp, g) in enumerate(zip(plan.blocks, cotangents, strict=True)):
            g = _cast(g, plan.reduce_dtype if bp.cast else None)
            if bp.transpose == "slice" or not bp.levels:
                lasts[i] = (g, None)
                continue
            for lv in reversed(bp.levels[1:]):
                out, pending = wire.reduce_scatter_start(_unassemble(g, lv), lv.comm, lv.dim)
                wire.wait(pending)
                g = out.narrow(lv.dim, 0, lv.own)
            lasts[i] = (_unassemble(g, bp.levels[0]), bp.levels[0])
        scattered = _scatters_start({i: (u, lv) for i, (u, lv) in lasts.items() if lv is not None})
        for i, (bp, dtype) in enumerate(zip(plan.blocks, dtypes, strict=True)):
            g, last = lasts[i]
            if bp.transpose == "slice":
                self.outputs.append(_slice(g, bp, dtype))
                continue
            if last is None:
                self.outputs.append(_cast(g, dtype) if g.dtype != dtype else g.clone())
                continue
            out, pending = scattered[i]
            self._pending += pending
            mine = out.narrow(last.dim, 0, last.own)
            if mine.dtype == dtype:
                self.outputs.append(mine)
            else:  # cast once the sum is there
                result = torch.empty(bp.block_shape, dtype=dtype, device=mine.device)
                self.outputs.append(result)
                self._finish.append(lambda r=result, m=mine: r.copy_(m))  # type: ignore[misc]

    def wait(self) -> None:
        wire.wait(self._pending)
        if self._stream is not None:
            self._stream.join(self.outputs)
        for finish in self._finish:
            finish()
        self._pending, self._finish, self._held = [], [], []


def _scatters_start(
    lasts: dict[int, tuple[torch.Tensor, Level]],
) -> dict[int, tuple[torch.Tensor, list[Any]]]:
    """Issue the reduce-scatters of the unassembled cotangents ``lasts`` (index ->
    cotangent, level): one each, or in a program one per axis and dtype (see
    :func:`_gathers_start`); each result is this rank's ``piece`` along the level's dim."""
    if active_trace() is None:
        return {i: wire.reduce_scatter_start(u, lv.comm, lv.dim) for i, (u, lv) in lasts.items()}
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, (u, lv) in lasts.items():
        groups.setdefault((lv.comm.key, u.dtype), []).append(i)
    out: dict[int, tuple[torch.Tensor, list[Any]]] = {}
    for members in groups.values():
        c = lasts[members[0]][1].comm
        slabs = []  # each (size, piece elements): rank r's slab in row r
        for i in members:
            u, lv = lasts[i]
            slabs.append(u.unflatten(lv.dim, (c.size, lv.piece)).movedim(lv.dim, 0).reshape(
                c.size, -1))  # fmt: skip
        summed, pending = wire.reduce_scatter_start(torch.cat(slabs, 1), c, 0)  # (1, total)
        start = 0
        for i in members:
            u, lv = lasts[i]
            shape = list(u.shape)
            shape[lv.dim] = lv.piece
            n = u.numel() // c.size
            out[i] = (summed[0, start : start + n].reshape(shape), pending)
            start += n
    return out


def _slice(g: torch.Tensor, bp: BlockPlan, dtype: torch.dtype) -> torch.Tensor:
    """This rank's block of the replicated whole cotangent ``g`` (an owned copy in ``dtype``)."""
    if bp.check is not None:
        bp.check(g)
    for lv in reversed(bp.levels):
        if lv.mine is not None:
            g = g.index_select(lv.dim, torch.tensor(lv.mine, dtype=torch.long, device=g.device))
            continue
        g = _pad(g, lv.dim, lv.comm.size * lv.piece)
        g = g.narrow(lv.dim, lv.comm.rank * lv.piece, lv.piece).narrow(lv.dim, 0, lv.own)
    return torch.empty(bp.block_shape, dtype=dtype, device=g.device).copy_(g)


# --- the operator the tape sees ------------------------------------------------------------------

# the plan and slot of the gather being run, beside the operator that runs it
_CARRIED: contextvars.ContextVar[tuple[int, UnitPlan, Slot | None] | None] = contextvars.ContextVar(
    "pshard_cast_gather", default=None
)


def _carried(plan_id: int) -> tuple[UnitPlan, Slot | None]:
    carried = _CARRIED.get()
    if carried is None or carried[0] != plan_id:
        raise RuntimeError(
            "pshard::cast_gather runs only inside CastGather (its plan travels beside it)"
        )
    return carried[1], carried[2]


@torch.library.custom_op("pshard::cast_gather", mutates_args=())
def _cast_gather_op(blocks: list[torch.Tensor], plan_id: int) -> list[torch.Tensor]:
    plan, slot = _carried(plan_id)
    taken = None if slot is None else slot.take(blocks)
    return taken if taken is not None else PendingGather(plan, blocks).wait()


@_cast_gather_op.register_fake
def _(blocks: list[torch.Tensor], plan_id: int) -> list[torch.Tensor]:
    plan, _ = _carried(plan_id)
    return [
        b.new_empty(bp.whole_shape, dtype=_cast(b[:0], plan.param_dtype if bp.cast else None).dtype)
        for b, bp in zip(blocks, plan.blocks, strict=True)
    ]


def _gather(plan: UnitPlan, slot: Slot | None, blocks: Sequence[torch.Tensor]) -> list[Any]:
    if active_trace() is not None:  # a program (ps.jit): its collectives, node by node
        taken = None if slot is None else slot.take(blocks)
        return taken if taken is not None else PendingGather(plan, blocks).wait()
    token = _CARRIED.set((id(plan), plan, slot))
    try:
        return list(_cast_gather_op(list(blocks), id(plan)))
    finally:
        _CARRIED.reset(token)


# --- the Functions -------------------------------------------------------------------------------


def _front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def _filled(ts: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(x) if t is None else t for t, x in zip(ts, like, strict=True)]


@eager_rules
class CastGather(torch.autograd.Function):
    """``(plan, slot, *blocks) -> wholes`` (see the module docs)."""

    @staticmethod
    def forward(plan: UnitPlan, slot: Slot | None, *blocks: torch.Tensor) -> tuple[Any, ...]:
        return tuple(_gather(plan, slot, blocks))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.slot = inputs[0], inputs[1]
        ctx.dtypes = tuple(b.dtype for b in inputs[2:])
        ctx.blocks = tuple(torch.empty(0, dtype=b.dtype, device=b.device) for b in inputs[2:])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        outs = call(CastScatter, ctx.plan, ctx.dtypes, ctx.slot, *grads)
        return (None, None, *outs)

    @staticmethod
    def jvp(ctx: Any, _plan: Any, _slot: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        like = [
            torch.zeros(bp.block_shape, dtype=d, device=b.device)
            for bp, d, b in zip(ctx.plan.blocks, ctx.dtypes, ctx.blocks, strict=True)
        ]
        return tuple(call(CastGather, ctx.plan, None, *_filled(tangents, like)))

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], plan: UnitPlan, slot: Slot | None, *blocks: Any
    ) -> Any:
        dims = in_dims[2:]
        if all(d is None for d in dims):
            return call(CastGather, plan, slot, *blocks), (None,) * len(blocks)
        outs, out_dims = [], []
        for i, (b, d) in enumerate(zip(blocks, dims, strict=True)):
            if d is None:
                (o,) = call(CastGather, plan.one(i), None, b)
            else:
                x = _front(b, d)
                (o,) = call(CastGather, plan.one(i, x.shape[0]), None, x)
            outs.append(o)
            out_dims.append(None if d is None else 0)
        return tuple(outs), tuple(out_dims)


@eager_rules
class CastScatter(torch.autograd.Function):
    """``(plan, dtypes, slot, *cotangents) -> block cotangents`` (see the module docs); the
    blocks' ``dtypes`` are those of :class:`CastGather`'s inputs."""

    @staticmethod
    def forward(
        plan: UnitPlan, dtypes: tuple[torch.dtype, ...], slot: Slot | None, *grads: torch.Tensor
    ) -> tuple[Any, ...]:
        stream = None if slot is None else slot.defers()
        pending = PendingScatter(plan, dtypes, grads, stream)
        if slot is not None and stream is not None:
            slot.defer(pending)
        else:
            pending.wait()
        return tuple(pending.outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.dtypes = inputs[0], inputs[1]
        ctx.grads = tuple(torch.empty(0, dtype=g.dtype, device=g.device) for g in inputs[3:])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, *call(CastGather, ctx.plan, None, *grads))

    @staticmethod
    def jvp(ctx: Any, _p: Any, _d: Any, _s: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        like = [
            torch.zeros(bp.whole_shape, dtype=g.dtype, device=g.device)
            for bp, g in zip(ctx.plan.blocks, ctx.grads, strict=True)
        ]
        return tuple(call(CastScatter, ctx.plan, ctx.dtypes, None, *_filled(tangents, like)))

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        plan: UnitPlan,
        dtypes: tuple[torch.dtype, ...],
        slot: Slot | None,
        *grads: Any,
    ) -> Any:
        dims = in_dims[3:]
        if all(d is None for d in dims):
            return call(CastScatter, plan, dtypes, None, *grads), (None,) * len(grads)
        outs, out_dims = [], []
        for i, (g, d) in enumerate(zip(grads, dims, strict=True)):
            if d is None:
                (o,) = call(CastScatter, plan.one(i), (dtypes[i],), None, g)
            else:
                x = _front(g, d)
                (o,) = call(CastScatter, plan.one(i, x.shape[0]), (dtypes[i],), None, x)
            outs.append(o)
            out_dims.append(None if d is None else 0)
        return tuple(outs), tuple(out_dims)


def cast_gather(
    plan: UnitPlan, blocks: Sequence[torch.Tensor], slot: Slot | None = None
) -> list[torch.Tensor]:
    """The wholes of ``blocks`` under ``plan``, differentiably (:class:`CastGather`); ``slot``:
    the unit's place in a schedule that may have gathered them ahead and may take its
    scatter to wait for later."""
    if torch.compiler.is_compiling():
        return list(apply.eager(CastGather, plan, None, *blocks))
    return list(call(CastGather, plan, slot, *blocks))

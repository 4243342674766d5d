"""The raw communication under pshard's collectives: plain tensors in, new tensors out.

No autograd here: the differentiable wrappers in ``pshard._collectives.functions`` call these from
their ``forward``. Every function takes contiguous copies only where the backend needs them and
moves data with one ``torch.distributed`` call (``batch_isend_irecv`` for permutations); tensors are
handed to the backend flattened to one dim, which every backend accepts for every layout.

While ``ps.jit`` traces (:mod:`pshard._runtime.tracing`), these functions move no data: each
returns the node of its collective that the trace emits (the ``*_start`` functions return it
with no pending work), and the program communicates when it runs.

One transport choice is made here: gloo's all-gathers of CPU tensors of
:data:`PAIRWISE_GATHER_BYTES` and more per rank go as one batch of pairwise sends and receives
(every rank's block straight into its slot of the output), which moves the same bytes 1.3 to 2
times as fast as gloo's own all-gather from there to 16 MB on 2 and 4 ranks; below it, neither is
reliably faster (``benchmarks/collectives.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._compat import constant_result, resolve_group
from .._core.tree import describe
from .debug import check_collective, debug_enabled, perm_code
from .mesh import Axis, AxisInfo, resolve_axis
from .ranges import profiling, ranged
from .tracing import active_trace, refuse
from .turns import current_task

T = TypeVar("T")

__all__ = [
    "PAIRWISE_GATHER_BYTES",
    "Comm",
    "Perm",
    "all_gather",
    "all_gather_start",
    "all_reduce",
    "all_to_all",
    "all_to_all_slots",
    "axis_key",
    "broadcast",
    "comm",
    "comm_at_run",
    "comm_of",
    "gather_into",
    "gather_parts",
    "pairwise",
    "ppermute",
    "ppermute_start",
    "ragged",
    "ragged_counts",
    "ragged_exchange",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_start",
    "wait",
]

Perm = tuple[tuple[int, int], ...]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Bytes per rank from which gloo's CPU all-gathers go as pairwise sends and receives.
PAIRWISE_GATHER_BYTES = 1 << 18


class Comm(NamedTuple):
    """A resolved axis plus whether debug checks are on; ``group`` is ``None`` for one rank.

    ``rank`` and every index a caller passes (``perm``, ``src``, ``dst``, block positions) are
    indices on the axis; ``order[i]`` is the group rank of index ``i`` when the two differ
    (:class:`pshard._runtime.mesh.AxisInfo`), and the functions below translate. ``key`` names
    the axis as a string for the compiled collectives (:mod:`pshard._collectives.compiled`); it
    is set only while ``torch.compile`` traces, empty otherwise."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    name: str
    debug: bool
    order: tuple[int, ...] | None = None
    key: str = ""


def comm(axis: Axis, fn: str) -> Comm:
    """Resolve ``axis`` in the current mesh. While ``torch.compile`` traces, the result is a
    constant of the trace, with its ``key`` (the compiled collectives resolve the key again
    when they run and check that it still gives this size and index)."""
    if torch.compiler.is_compiling():
        return _traced_comm(axis, fn)
    if active_trace() is not None:  # ps.jit: the ops the trace emits resolve the key again
        return _resolve(axis, fn)._replace(key=axis_key(axis))
    return _resolve(axis, fn)


def comm_of(axis: Axis, info: AxisInfo, debug: bool) -> Comm:
    """The :class:`Comm` of ``axis`` already resolved to ``info`` (with its key: the ops of a
    traced program resolve it again when they run)."""
    return Comm(info.group, info.size, info.rank, info.name, debug, info.order, axis_key(axis))


def _resolve(axis: Axis, fn: str) -> Comm:
    info = resolve_axis(axis, fn=fn)
    return Comm(info.group, info.size, info.rank, info.name, debug_enabled(), info.order)


@constant_result
def _traced_comm(axis: Axis, fn: str) -> Comm:
    # Context variables (the current mesh) cannot be read by the tracer: resolve here, in plain
    # Python, and let the trace hold the result; running the graph checks it (comm_at_run).
    if current_task() is not None:
        raise RuntimeError(
            f"{fn}: torch.compile does not run in in-process ranks (ps.spawn(..., "
            f"backend='threads')): the ranks share one process's compiled code, specialised to "
            f"the rank that traced it; compile in processes (backend='gloo' or 'nccl', or "
            f"torchrun), or run this rank's code eagerly"
        )
    return _resolve(axis, fn)._replace(key=axis_key(axis))


def axis_key(axis: Axis) -> str:
    """``axis`` as a string: a JSON list of mesh-axis names, or ``{"group": name}``."""
    if isinstance(axis, dist.ProcessGroup):
        return json.dumps({"group": axis.group_name})
    return json.dumps([axis] if isinstance(axis, str) else list(axis))


def comm_at_run(key: str, size: int, rank: int, fn: str) -> Comm:
    """Resolve an :func:`axis_key` when a compiled collective runs, in the current mesh.

    Raises:
        RuntimeError: the axis now has another size, or this rank another index on it, than
            when the function was traced (its shapes and its rank-dependent code would be wrong).
    """
    spec = json.loads(key.partition("#")[0])  # (a traced program's node: "#" and its place)
    axis: Axis
    if isinstance(spec, dict):
        axis = resolve_group(spec["group"])
    else:
        axis = spec[0] if len(spec) == 1 else tuple(spec)
    c = _resolve(axis, fn)
    if (c.size, c.rank) != (size, rank):
        raise RuntimeError(
            f"{fn}: this compiled function was traced with axis {c.name!r} of size {size} and "
            f"this rank at index {rank}, but the current mesh gives size {c.size} and index "
            f"{c.rank}; a compiled function is specialised to the mesh it was traced in: "
            f"compile it again for this mesh (torch._dynamo.reset(), or a new torch.compile)"
        )
    return c


def _ranged(op: str | None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A wire function as a profiler range ``pshard.<op>[<axis>]`` (``op`` None: the function's
    third argument names it, ``all_reduce``'s ``"psum"``); free while no profiler runs."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> T:  # (no local named c: see stalls.py)
            if not profiling():
                return fn(*args, **kwargs)
            name = op if op is not None else args[2]
            with torch.profiler.record_function(f"pshard.{name}[{args[1].name}]"):
                return fn(*args, **kwargs)

        return run

    return wrap


def _emitted(name: str, x: torch.Tensor, c: Comm, *params: Any) -> torch.Tensor | None:
    """While a trace is active: the node of collective ``name`` it emits; else ``None``."""
    trace = active_trace()
    return None if trace is None else trace.emit(name, x, c, params)


def _peer(c: Comm, index: int) -> int:
    """The global rank of index ``index`` on the axis."""
    return _global(c.group, index if c.order is None else c.order[index])


def _by_index(blocks: torch.Tensor, c: Comm) -> torch.Tensor:
    """Blocks in group-rank order (dim 0) -> in axis-index order."""
    if c.order is None:
        return blocks
    return blocks.index_select(0, torch.tensor(c.order, device=blocks.device))


def _by_group(blocks: torch.Tensor, c: Comm) -> torch.Tensor:
    """Blocks in axis-index order (dim 0) -> in group-rank order."""
    if c.order is None:
        return blocks
    inverse = [0] * c.size
    for i, g in enumerate(c.order):
        inverse[g] = i
    return blocks.index_select(0, torch.tensor(inverse, device=blocks.device))


@_ranged(None)
def all_reduce(x: torch.Tensor, c: Comm, op: str) -> torch.Tensor:
    if (t := _emitted(*(("psum",) if op == "psum" else ("pextreme",)), x, c,
                      *(() if op == "psum" else (op,)))) is not None:  # fmt: skip
        return t
    if c.debug:
        check_collective(op, c.group, c.name, x)
    out = x.clone(memory_format=torch.contiguous_format)
    red = {"psum": dist.ReduceOp.SUM, "pmax": dist.ReduceOp.MAX, "pmin": dist.ReduceOp.MIN}[op]
    dist.all_reduce(out, op=red, group=c.group)
    return out


@_ranged("all_gather")
def all_gather(x: torch.Tensor, c: Comm, dim: int, tiled: bool) -> torch.Tensor:
    if (t := _emitted("all_gather", x, c, dim, tiled)) is not None:
        return t
    if c.debug:
        check_collective("all_gather", c.group, c.name, x, (dim, int(tiled)))
    inp = x.contiguous()
    buf = inp.new_empty((c.size, *inp.shape))
    gather_into(buf, inp, c.group)
    buf = _by_index(buf, c)
    if tiled:  # (n, ..., s_dim, ...) -> (..., n * s_dim, ...), rank-major
        return buf.movedim(0, dim).flatten(dim, dim + 1)
    return buf.movedim(0, dim).contiguous()


def gather_into(buf: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every group rank's contiguous ``inp`` into ``buf[group rank]``; ``buf`` is contiguous,
    of shape ``(group size, *inp.shape)``."""
    refuse("an all-gather into a buffer", "it writes into its argument")
    size = dist.get_world_size(group)
    if size > 1 and pairwise(inp, group):
        me = dist.get_rank(group)
        buf[me].copy_(inp)
        wait(
            _shifted_start(me, size, lambda g: _global(group, g), [inp], [[b] for b in buf], group)
        )
        return
    _all_gather_flat(buf.view(-1), inp.view(-1), group=group)  # flat: any backend, no copy


def pairwise(x: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether gathering ``x`` (this rank's block) over ``group`` goes as pairwise sends and
    receives: a CPU tensor of :data:`PAIRWISE_GATHER_BYTES` or more on gloo."""
    return (
        x.device.type == "cpu"
        and x.numel() * x.element_size() >= PAIRWISE_GATHER_BYTES
        and "gloo" in str(dist.get_backend(group)).lower()
    )


def gather_parts(
    x: torch.Tensor, send: Sequence[torch.Tensor], recv: Sequence[Sequence[torch.Tensor]], c: Comm
) -> None:
    with ranged(lambda: f"pshard.all_gather[{c.name}]"):
        _gather_parts(x, send, recv, c)


def _gather_parts(
    x: torch.Tensor, send: Sequence[torch.Tensor], recv: Sequence[Sequence[torch.Tensor]], c: Comm
) -> None:
    """Every index's parts of its block straight into their places: ``send`` are parts of this
    rank's block ``x``, ``recv[i]`` the tensors (views of an output, say) that take index
    ``i``'s parts, one per part, in order; ``recv[c.rank]`` are copied from ``send`` here. All
    contiguous. The pairwise all-gather of :func:`gather_into` without its buffer, for blocks
    whose parts land apart."""
    if active_trace() is not None:  # each part gathered, then into its places
        for j, part in enumerate(send):
            blocks = _emitted("all_gather", part.contiguous(), c, 0, False)
            assert blocks is not None
            for i, parts in enumerate(recv):
                parts[j].copy_(blocks[i])
        return
    if c.debug:
        check_collective("all_gather", c.group, c.name, x)
    for dst, src in zip(recv[c.rank], send, strict=True):
        dst.copy_(src)
    wait(_shifted_start(c.rank, c.size, lambda i: _peer(c, i), send, recv, c.group))


def _shifted_start(
    me: int,
    size: int,
    peer: Callable[[int], int],
    send: Sequence[torch.Tensor],
    recv: Sequence[Sequence[torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> list[Any]:
    """Issue one batch of sends and receives with shifted partners (at step ``s`` every rank
    sends to ``me + s`` and receives from ``me - s``): ``send`` to every other index, ``recv[i]``
    from index ``i``, part ``j`` with tag ``j``; ``peer`` maps an index to a global rank. Returns
    the pending work."""
    ops = []
    for step in range(1, size):
        to, frm = (me + step) % size, (me - step) % size
        ops += [dist.P2POp(dist.isend, t, peer(to), group, j) for j, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, peer(frm), group, j) for j, t in enumerate(recv[frm])]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


@_ranged("all_gather")
def all_gather_start(x: torch.Tensor, c: Comm) -> tuple[torch.Tensor, list[Any]]:
    """Issue an all-gather of ``x`` over ``c`` and return at once: the output, of shape
    ``(c.size, *x.shape)`` with index ``i``'s ``x`` at ``[i]`` once ``wait(pending)`` returns,
    and the pending work (holding what the transport reads). ``x`` must not be written to
    before then. Every rank issues its
    collectives on a group in the same order, the pending ones included (they are matched in
    order, as the blocking ones are). The transport is :func:`all_gather`'s (gloo's large CPU
    blocks as pairwise sends and receives straight into their slots)."""
    if (t := _emitted("all_gather", x, c, 0, False)) is not None:
        return t, []
    if c.debug:
        check_collective("all_gather", c.group, c.name, x, (0, 0))
    inp = x.contiguous()
    buf = inp.new_empty((c.size, *inp.shape))
    if c.order is None and not pairwise(inp, c.group):
        work = _all_gather_flat(buf.view(-1), inp.view(-1), group=c.group, async_op=True)
        return buf, [work, inp]
    # pairwise: each index's block straight into its slot (axis-index order, any group order)
    buf[c.rank].copy_(inp)
    peer = lambda i: _peer(c, i)  # noqa: E731
    return buf, [*_shifted_start(c.rank, c.size, peer, [inp], [[b] for b in buf], c.group), inp]


@_ranged("psum_scatter")
def reduce_scatter_start(x: torch.Tensor, c: Comm, dim: int) -> tuple[torch.Tensor, list[Any]]:
    """Issue :func:`reduce_scatter` of ``x`` (``tiled=True``) and return at once: the output,
    this index's sum once ``wait(pending)`` returns, and the pending work, which holds what the
    transport reads (``x`` may be written to at once)."""
    if (t := _emitted("psum_scatter", x, c, dim, True)) is not None:
        return t, []
    if c.debug:
        check_collective("psum_scatter", c.group, c.name, x, (dim, 1))
    blocks = x.unflatten(dim, (c.size, -1))
    inp = _by_group(blocks.movedim(dim, 0), c).contiguous()
    out = inp.new_empty(inp.shape[1:])
    work = _reduce_scatter_flat(out.view(-1), inp.view(-1), group=c.group, async_op=True)
    return out, [work, inp]


@_ranged("psum_scatter")
def reduce_scatter(x: torch.Tensor, c: Comm, dim: int, tiled: bool) -> torch.Tensor:
    if (t := _emitted("psum_scatter", x, c, dim, tiled)) is not None:
        return t
    if c.debug:
        check_collective("psum_scatter", c.group, c.name, x, (dim, int(tiled)))
    blocks = x.unflatten(dim, (c.size, -1)) if tiled else x.unsqueeze(dim + 1)
    inp = _by_group(blocks.movedim(dim, 0), c).contiguous()  # slab g goes to group rank g
    out = inp.new_empty(inp.shape[1:])
    _reduce_scatter_flat(out.view(-1), inp.view(-1), group=c.group)
    return out if tiled else out.squeeze(dim)


@_ranged("all_to_all")
def all_to_all(x: torch.Tensor, c: Comm, split_dim: int, concat_dim: int) -> torch.Tensor:
    if (t := _emitted("all_to_all", x, c, split_dim, concat_dim)) is not None:
        return t
    if c.debug:
        check_collective("all_to_all", c.group, c.name, x, (split_dim, concat_dim))
    inp = _by_group(x.unflatten(split_dim, (c.size, -1)).movedim(split_dim, 0), c).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out.view(-1), inp.view(-1), group=c.group)  # out[g]: from group rank g
    return _by_index(out, c).movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


@_ranged("all_to_all")
def all_to_all_slots(send: torch.Tensor, c: Comm) -> torch.Tensor:
    """The all-to-all of a ``(group size, ...)`` buffer whose block ``g`` goes to group rank
    ``g``; the result's block ``g`` came from group rank ``g`` (the buffers the caller packed
    itself, in group-rank order)."""
    if c.debug:
        check_collective("all_to_all", c.group, c.name, send, (0, 0))
    if active_trace() is not None:  # the op takes and gives blocks by axis index
        out = _emitted("all_to_all", _by_index(send, c), c, 0, 0)
        assert out is not None
        return _by_group(out, c)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=c.group)
    return recv


def ppermute(x: torch.Tensor, c: Comm, perm: Perm) -> torch.Tensor:
    out, pending = ppermute_start(x, c, perm)
    wait(pending)
    return out


@_ranged("ppermute")
def ppermute_start(x: torch.Tensor, c: Comm, perm: Perm) -> tuple[torch.Tensor, list[Any]]:
    """Issue a ppermute and return at once: the output tensor (filled once ``wait(pending)``
    returns) and the pending work. ``x`` must not be written to before then. Every rank must
    issue its ppermutes in the same order (they are matched in order, per pair of ranks)."""
    if (t := _emitted("ppermute", x, c, perm)) is not None:
        return t, []
    if c.debug and c.group is not None:
        check_collective("ppermute", c.group, c.name, x, (perm_code(perm),))
    out = None
    ops = []
    inp = x.contiguous()
    for src, dst in perm:
        if src == dst == c.rank:
            out = x.clone(memory_format=torch.contiguous_format)
        elif src == c.rank:
            ops.append(dist.P2POp(dist.isend, inp, _peer(c, dst), c.group))
        elif dst == c.rank:
            out = torch.empty_like(inp)
            ops.append(dist.P2POp(dist.irecv, out, _peer(c, src), c.group))
    pending = dist.batch_isend_irecv(ops) if ops else []
    return (torch.zeros_like(inp) if out is None else out), pending


def wait(pending: list[Any]) -> None:
    """Wait for the work returned by :func:`ppermute_start`, :func:`all_gather_start` or
    :func:`reduce_scatter_start` (tensors in the list are what the work reads, held)."""
    with ranged(lambda: "pshard.wait"):
        _wait(pending)


def _wait(pending: list[Any]) -> None:
    for work in pending:
        if not isinstance(work, torch.Tensor):
            work.wait()


@_ranged("broadcast")
def broadcast(x: torch.Tensor, c: Comm, src: int) -> torch.Tensor:
    if (t := _emitted("broadcast", x, c, src)) is not None:
        return t
    if c.debug:
        check_collective("broadcast", c.group, c.name, x, (src,))
    out = x.clone(memory_format=torch.contiguous_format)
    dist.broadcast(out, src=_peer(c, src), group=c.group)
    return out


@_ranged("reduce")
def reduce(x: torch.Tensor, c: Comm, dst: int) -> torch.Tensor:
    if (t := _emitted("reduce", x, c, dst)) is not None:
        return t
    if c.debug:
        check_collective("reduce", c.group, c.name, x, (dst,))
    out = x.clone(memory_format=torch.contiguous_format)
    dist.reduce(out, dst=_peer(c, dst), group=c.group)
    return out if c.rank == dst else out.zero_()


def _count_row(send_counts: Any, rows: int, size: int) -> tuple[list[int], str]:
    """This rank's counts and what is wrong with them ("" when nothing is)."""
    if not isinstance(send_counts, torch.Tensor) or send_counts.dim() != 1:
        return [0] * size, f"is {describe(send_counts)}, not a 1-D integer tensor"
    if send_counts.is_floating_point() or send_counts.is_complex():
        return [0] * size, f"has dtype {send_counts.dtype}, not an integer dtype"
    counts = [int(v) for v in send_counts.tolist()]
    if len(counts) != size:
        return [0] * size, f"has {len(counts)} entries, but the axis has {size} ranks"
    if any(v < 0 for v in counts):
        return [0] * size, f"has a negative count ({counts})"
    if sum(counts) != rows:
        return [0] * size, f"sums to {sum(counts)}, but x has {rows} rows"
    return counts, ""


def ragged_counts(
    send_counts: Any, rows: int, c: Comm, fn: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every rank's ``send_counts`` checked and exchanged in one small all-gather: this rank's
    counts to send and to receive (per index).

    Raises:
        ValueError: on every rank, when the counts of any rank are of the wrong length,
            negative, or do not sum to its ``rows`` (naming ``send_counts`` and the ranks).
    """
    counts, wrong = _count_row(send_counts, rows, c.size)
    if c.group is None:
        if wrong:
            raise ValueError(f"{fn}: send_counts on rank 0 {wrong}")
        return tuple(counts), tuple(counts)
    row = torch.tensor([0 if wrong else 1, *counts], dtype=torch.int64)
    table = all_gather(row, c, 0, False).tolist()  # (ranks, 1 + size)
    bad = [r for r, t in enumerate(table) if not t[0]]
    if bad:
        mine = f" (here, rank {c.rank}: send_counts {wrong})" if wrong else ""
        raise ValueError(
            f"{fn}: send_counts are wrong on rank{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))} of axis {c.name!r}{mine}: each rank passes a 1-D "
            f"integer tensor of {c.size} counts, none negative, summing to its x's rows; no "
            f"rows were sent"
        )
    return tuple(counts), tuple(int(table[src][1 + c.rank]) for src in range(c.size))


def ragged(
    x: torch.Tensor, send_counts: torch.Tensor, c: Comm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ragged_all_to_all`` with the counts as a tensor: ``(y, recv_counts)``. While a trace
    is active, its node (the rows received are as many as the data say)."""
    trace = active_trace()
    if trace is not None:
        out: tuple[torch.Tensor, torch.Tensor] = trace.emit(
            "ragged_all_to_all", x, c, (send_counts,)
        )
        return out
    send, recv = ragged_counts(send_counts, x.shape[0], c, "ragged_all_to_all")
    y = ragged_exchange(x, c, send, recv)
    return y, torch.tensor(recv, dtype=send_counts.dtype, device=send_counts.device)


@_ranged("ragged_all_to_all")
def ragged_exchange(
    x: torch.Tensor, c: Comm, send: Sequence[int], recv: Sequence[int]
) -> torch.Tensor:
    """The rows of ``x`` grouped by destination index (``send[i]`` rows for index ``i``, in
    index order) sent to their indices; the rows received, grouped by source index
    (``recv[i]`` from index ``i``). Pairwise sends and receives of the parts that are not
    empty (every backend; both sides know every count)."""
    refuse("ragged_all_to_all", "the rows each rank receives are data (their counts decide "
           "the output's shape)")  # fmt: skip
    inp = x.contiguous()
    out = inp.new_empty((sum(recv), *inp.shape[1:]))
    starts = [sum(send[:i]) for i in range(c.size)]
    at = [sum(recv[:i]) for i in range(c.size)]
    out[at[c.rank] : at[c.rank] + recv[c.rank]].copy_(
        inp[starts[c.rank] : starts[c.rank] + send[c.rank]]
    )
    ops = []
    for step in range(1, c.size):
        to, frm = (c.rank + step) % c.size, (c.rank - step) % c.size
        if send[to]:
            part = inp[starts[to] : starts[to] + send[to]]
            ops.append(dist.P2POp(dist.isend, part, _peer(c, to), c.group))
        if recv[frm]:
            slot = out[at[frm] : at[frm] + recv[frm]]
            ops.append(dist.P2POp(dist.irecv, slot, _peer(c, frm), c.group))
    if ops:
        _wait(list(dist.batch_isend_irecv(ops)))
    return out

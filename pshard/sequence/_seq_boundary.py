"""The boundary of one split sequence: this rank's tokens (padded, in the layout's order) of a
whole value on the way in, every rank's tokens gathered and put in sequence order on the way out.

- :func:`take_tokens` / :func:`place_tokens`: the two directions as ``shard_map_seq`` uses them,
  each the other's transpose (a whole input's gradient gathers every rank's cotangent; a whole
  output's cotangent is sliced), ranks counted in the axis's order;
- :class:`SeqBoundary`: the boundary of the ``sequence_parallel`` hooks, which have no map
  around them, built on the same layout functions (:mod:`pshard.sequence._layouts`), the same
  gather and the reduce Function of :mod:`pshard._shard_map.boundary`, with errors that name
  the caller.

Gradient convention of the hooks (one for everything that crosses the boundary): after the
backward pass each rank holds *its tokens' share* of every gradient, for the parameters and for
the inputs alike, and :func:`pshard.reduce_gradients` (a sum over the axis) completes them:

- ``split(..., share=True)``: the transpose of taking this rank's block is putting the cotangent
  back at this rank's positions, zeros elsewhere (no communication), so an input's gradient is
  this rank's share, like a parameter's;
- ``gather``: a whole value, the same on every rank; each rank's cotangent is sliced (no
  communication);
- ``reduce``: the sum of every rank's value (a loss share per rank); the cotangent, the same on
  every rank, passes to each share unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.placements import Shard
from .._runtime.debug import debug_enabled
from .._runtime.mesh import resolve_axis
from .._runtime.wire import Comm, all_gather, comm_of, gather_parts, pairwise
from .._shard_map.boundary import BlockLayout, FromBlocks, exchange_shapes
from ._layouts import SeqLayout, along, pad_permute, place_blocks, take_blocks

__all__ = ["SeqBoundary", "place_tokens", "share_tokens", "take_tokens"]


class _TakeTokens(torch.autograd.Function):
    """``(x, dim, layout, c, pad)``: this rank's tokens of the whole ``x`` along ``dim`` (one copy
    of its runs, padding slots ``pad``); ``c`` is the axis, ``None`` for one rank. The transpose
    (a whole value's gradient, the same on every rank) gathers every rank's cotangent block and
    puts each token at its position."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, layout: SeqLayout, c: Comm | None, pad: Any) -> Any:
        return take_blocks(x, dim, layout, pad, (0 if c is None else c.rank,))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.layout, ctx.c = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _PlaceTokens.apply(g, ctx.dim, ctx.layout, ctx.c, None), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _TakeTokens.apply(t, ctx.dim, ctx.layout, ctx.c, 0)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, dim: int, layout: SeqLayout, c, pad):
        return _TakeTokens.apply(x.movedim(in_dims[0], 0), dim + 1, layout, c, pad), 0


class _PlaceTokens(torch.autograd.Function):
    """``(y, dim, layout, c, label)``: the whole sequence from every rank's block ``y`` (gathered
    over ``c`` in axis-index order), each token at its position, padding dropped; with
    ``label`` (the output's key path and spec) the ranks first check that their blocks have one
    shape. The transpose of :class:`_TakeTokens` (whose transpose it is in turn, with zeros in
    the padding slots)."""

    @staticmethod
    def forward(y: torch.Tensor, dim: int, layout: SeqLayout, c: Comm | None, label: Any) -> Any:
        if c is None:
            return place_blocks((y,), dim, layout)
        if label is not None:
            lay = BlockLayout(
                shards=(Shard(dim),), sizes=(c.size,), coord=(c.rank,), perm=(0,), gather=c,
                label=label,
            )  # fmt: skip
            exchange_shapes(y, lay)
        out = _place_direct(y, dim, layout, c)
        if out is None:
            out = place_blocks(all_gather(y, c, 0, False).unbind(0), dim, layout)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.layout, ctx.c = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _TakeTokens.apply(g, ctx.dim, ctx.layout, ctx.c, 0), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _PlaceTokens.apply(t, ctx.dim, ctx.layout, ctx.c, None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, y: torch.Tensor, dim: int, layout: SeqLayout, c, label):
        return _PlaceTokens.apply(y.movedim(in_dims[0], 0), dim + 1, layout, c, label), 0


#: Bytes from which a piece of a placed gather (one row's run, with a batch before the sequence
#: dim) goes as a message of its own. Each message costs about 80 us on gloo over loopback; a
#: boundary of three inputs and one output (fwd + bwd, 2 ranks) took 0.84-0.92x the buffered
#: gathers' time with pieces of 512 KiB to 4 MiB, 0.95x with 16 rows of 512 KiB, and 1.06x
#: with 16 rows of 256 KiB (``benchmarks/sequence_parallel.py --boundary-only``).
DIRECT_PIECE_BYTES = 1 << 19


def _place_direct(y: torch.Tensor, dim: int, layout: SeqLayout, c: Comm) -> torch.Tensor | None:
    """:class:`_PlaceTokens`'s gather with every rank's runs received straight into their
    positions (no gathered buffer, no second copy): pairwise gathers
    (:func:`pshard._runtime.wire.pairwise`) of runs of consecutive positions (contiguous, zigzag),
    each run of each row before ``dim`` one piece of memory in the block and in the whole, sent as a
    message of its own; with a batch before ``dim``, only when every piece has
    :data:`DIRECT_PIECE_BYTES`. ``None`` elsewhere. Decided from what every rank shares (shapes,
    dtype, layout), never from strides: the ranks must all take one path."""
    if not pairwise(y, c.group):
        return None
    runs = [layout.runs(i) for i in range(c.size)]
    if any(count > 1 and stride != 1 for r in runs for _, _, count, stride in r):
        return None
    real = [
        [(lo, first, n) for lo, first, cnt, _ in r if (n := layout.real(first, cnt, 1))]
        for r in runs
    ]
    rows = math.prod(y.shape[:dim])
    per_token = math.prod(y.shape[dim + 1 :]) * y.element_size()
    if rows > 1 and any(n * per_token < DIRECT_PIECE_BYTES for r in real for *_, n in r):
        return None
    shape = list(y.shape)
    shape[dim] = layout.length
    out = y.new_empty(shape)
    block = y.contiguous().view(rows, *y.shape[dim:])
    whole = out.view(rows, *shape[dim:])
    send = [block[p].narrow(0, lo, n) for p in range(rows) for lo, _, n in real[c.rank]]
    recv = [[whole[p].narrow(0, first, n) for p in range(rows) for _, first, n in r] for r in real]
    gather_parts(y, send, recv, c)
    return out


def take_tokens(
    x: torch.Tensor, dim: int, layout: SeqLayout, c: Comm | None, pad: Any
) -> torch.Tensor:
    """This rank's tokens of the whole ``x`` along ``dim`` (``layout.length`` long), padding
    slots ``pad``, as ``pad_permute`` then this rank's block would give them, without building
    the permuted whole; differentiable (see :class:`_TakeTokens`)."""
    return _TakeTokens.apply(x, dim, layout, c, pad)


def place_tokens(
    y: torch.Tensor, dim: int, layout: SeqLayout, c: Comm | None, label: str
) -> torch.Tensor:
    """The whole sequence along ``dim`` from every rank's tokens ``y`` (this rank's block under
    ``layout``), in sequence order, padding dropped; the ranks' blocks must have one shape
    (checked first: ``label`` names the output in the error). Differentiable, the transpose of
    :func:`take_tokens` (zero padding)."""
    return _PlaceTokens.apply(y, dim, layout, c, label)


class _ShareTokens(torch.autograd.Function):
    """``(x, dim, layout, rank, pad)``: ``rank``'s tokens of the whole ``x`` along ``dim``
    (padding slots ``pad``); the transpose puts the cotangent back at this rank's positions,
    zeros elsewhere (this rank's share, see the module docs)."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, layout: SeqLayout, rank: int, pad: Any) -> Any:
        return take_blocks(x, dim, layout, pad, (rank,))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[1:4]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _Share.apply(g, *ctx.args), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _ShareTokens.apply(t, *ctx.args, 0)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, dim: int, layout: SeqLayout, rank, pad):
        return _ShareTokens.apply(x.movedim(in_dims[0], 0), dim + 1, layout, rank, pad), 0


class _Share(torch.autograd.Function):
    """``(g, dim, layout, rank)``: the whole sequence with ``rank``'s real tokens ``g`` at their
    positions, zeros elsewhere; the transpose of :class:`_ShareTokens` (and its own transpose is
    that, with zero padding)."""

    @staticmethod
    def forward(g: torch.Tensor, dim: int, layout: SeqLayout, rank: int) -> Any:
        shape = list(g.shape)
        shape[dim] = layout.length
        out = g.new_zeros(shape)
        for local, first, count, stride in layout.runs(rank):
            real = layout.real(first, count, stride)
            if real:
                along(out, dim, first, real, stride).copy_(g.narrow(dim, local, real))
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[1:4]

    @staticmethod
    def backward(ctx: Any, h: torch.Tensor) -> tuple[Any, ...]:
        return _ShareTokens.apply(h, *ctx.args, 0), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _Share.apply(t, *ctx.args)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, g: torch.Tensor, dim: int, layout: SeqLayout, rank):
        return _Share.apply(g.movedim(in_dims[0], 0), dim + 1, layout, rank), 0


def share_tokens(x: torch.Tensor, dim: int, layout: SeqLayout, rank: int, pad: Any) -> torch.Tensor:
    """``rank``'s tokens of the whole ``x`` along ``dim`` (``layout.length`` long; padding
    slots ``pad``), whose transpose puts the cotangent back at ``rank``'s positions, zeros
    elsewhere: this rank's share (see the module docs). Differentiable in every mode (its
    transpose's transpose is itself, with zero padding)."""
    return _ShareTokens.apply(x, dim, layout, rank, pad)


class SeqBoundary:
    """The boundary of one call: ``fn`` (the caller's name), the axis (resolved in ``mesh``) and
    the sequence layout."""

    def __init__(self, fn: str, mesh: DeviceMesh, names: tuple[str, ...], layout: SeqLayout):
        info = resolve_axis(names, mesh=mesh, fn=fn)
        self.fn, self.layout, self.mesh = fn, layout, mesh
        self.rank, self.size = info.rank, info.size
        self.comm = None if info.group is None else comm_of(names, info, debug_enabled())

    def split(self, x: torch.Tensor, dim: int, pad: Any) -> torch.Tensor:
        """This rank's tokens of ``x`` along ``dim`` (padded with ``pad``, permuted); the
        transpose is this rank's share (see the module docs)."""
        if self.comm is None:
            return pad_permute(x, dim, self.layout, pad)
        return share_tokens(x, dim % x.dim(), self.layout, self.rank, pad)

    def take(self, x: torch.Tensor, dim: int, pad: Any) -> torch.Tensor:
        """This rank's tokens of ``x`` (no autograd; for ids and masks)."""
        return take_blocks(x, dim % x.dim(), self.layout, pad, (self.rank,))

    def gather(self, y: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """The whole sequence from every rank's tokens ``y`` along ``dim``, in sequence order."""
        dim %= y.dim()
        return place_tokens(y, dim, self.layout, self.comm, f"{self.fn} {where} (Shard({dim}))")

    def reduce(self, y: torch.Tensor, where: str) -> torch.Tensor:
        """The sum over the axis of every rank's ``y`` (each rank's share of a loss)."""
        if self.comm is None:
            return y
        lay = BlockLayout(rep=self.comm, label=f"{self.fn} {where} (Partial('sum'))")
        return FromBlocks.apply(y, lay, True, 1.0, None, None)

"""Ulysses' two all-to-alls with the sequence layout folded into their buffers.

- :func:`tokens_to_heads`: this rank's tokens of every head -> every token of ``heads / N`` of
  the heads, in *sequence order* with the padding dropped, as ``(batch..., heads / N, seq,
  size)`` tensors (what attention kernels take);
- :func:`heads_to_tokens`: the inverse and transpose, back to this rank's tokens in the
  caller's dim order.

Each is one ``all_to_all_single`` of one buffer that packs every tensor given (q, k and v travel
together). The copy into the send buffer splits the heads (and moves the caller's dims to the
buffer's token-major order); the copy out of the receive buffer puts each rank's tokens at
their positions in the sequence, one strided copy per run of positions
(:meth:`SeqLayout.runs`), so the layout's permutation costs no index tensors, no
``index_select`` and, in the backward pass, no ``index_add_`` into a zero-filled buffer.
Nothing is zero-filled but the send slots of padding tokens. The backward of each is the other
(both are linear), so gradients of any order, ``jvp`` and ``vmap`` compose.
"""

from __future__ import annotations

from typing import Any

import torch

from .._collectives import apply
from .._collectives.apply import call, eager_rules
from .._runtime.wire import Comm, all_to_all_slots
from ._layouts import SeqLayout, along

__all__ = ["tokens_to_heads", "heads_to_tokens"]

Shape = tuple[int, ...]


def _slot(c: Comm, i: int) -> int:
    """Where axis index ``i``'s block sits in the all-to-all buffers (its group rank)."""
    return i if c.order is None else c.order[i]


def _buffers(shapes: list[Shape], c: Comm, like: torch.Tensor) -> tuple[torch.Tensor, list]:
    """An uninitialised ``(N, total)`` send buffer and a view of it per block shape (the same
    ``(N, *shape)`` for every rank)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    buf = like.new_empty((c.size, sum(sizes)))
    return buf, _parts(buf, shapes, sizes)


def _parts(buf: torch.Tensor, shapes: list[Shape], sizes: list[int] | None = None) -> list:
    if sizes is None:
        sizes = [int(torch.Size(s).numel()) for s in shapes]
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(buf[:, start : start + size].view(buf.shape[0], *shape))
        start += size
    return out


def _all_to_all(send: torch.Tensor, c: Comm) -> torch.Tensor:
    if c.group is None:
        return send
    return all_to_all_slots(send, c)


def _tokens(x: torch.Tensor, start: int, count: int, stride: int) -> torch.Tensor:
    """Tokens ``start + j * stride`` (``j < count``) of ``x`` (tokens on dim -3), a view."""
    return along(x, x.dim() - 3, start, count, stride)


# The blocks in the buffers are token-major, (batch..., tokens, heads / N, size): packing is a
# copy of runs of whole heads, and the attention tensors are transposed views of token-major
# memory, the layout the CPU and CUDA fused kernels read (and write their outputs in).


def _to_heads(layout: SeqLayout, c: Comm, sd: int, hd: int, ts: tuple) -> tuple:
    n = c.size
    tokens_major = [t.movedim((sd, hd), (-3, -2)) for t in ts]  # (batch..., L, heads, size)
    shapes = [(*x.shape[:-2], x.shape[-2] // n, x.shape[-1]) for x in tokens_major]
    send, parts = _buffers(shapes, c, ts[0])
    for x, part in zip(tokens_major, parts, strict=True):
        blocks = x.unflatten(-2, (n, -1)).movedim(-3, 0)  # (N, batch..., L, heads / N, size)
        if c.order is None:
            part.copy_(blocks)
        else:
            for i in range(n):
                part[_slot(c, i)].copy_(blocks[i])
    recv = _all_to_all(send, c)
    outs = []
    for part, shape in zip(_parts(recv, shapes), shapes, strict=True):
        out = part.new_empty((*shape[:-3], layout.padded_length, *shape[-2:]))
        for i in range(n):
            block = part[_slot(c, i)]
            for local, first, count, stride in layout.runs(i):
                if count:
                    _tokens(out, first, count, stride).copy_(_tokens(block, local, count, 1))
        if layout.num_pad:
            out = out.narrow(-3, 0, layout.length)
        outs.append(out.transpose(-3, -2))
    return tuple(outs)


def _token_shape(batch: Shape, length: int, heads: int, size: int, sd: int, hd: int) -> Shape:
    """The shape, in the caller's dim order, of ``(batch..., length, heads, size)``."""
    shape = [0] * (len(batch) + 3)
    shape[sd], shape[hd], shape[-1] = length, heads, size
    rest = iter(batch)
    for d in range(len(shape) - 1):
        if d not in (hd, sd):
            shape[d] = next(rest)
    return tuple(shape)


def _to_tokens(layout: SeqLayout, c: Comm, sd: int, hd: int, hs: tuple) -> tuple:
    n, local_length = c.size, layout.local_length
    hs = tuple(h.transpose(-3, -2) for h in hs)  # (batch..., seq, heads / N, size)
    shapes = [(*h.shape[:-3], local_length, *h.shape[-2:]) for h in hs]
    send, parts = _buffers(shapes, c, hs[0])
    for h, part in zip(hs, parts, strict=True):
        for i in range(n):
            block = part[_slot(c, i)]
            for local, first, count, stride in layout.runs(i):
                real = layout.real(first, count, stride)
                if real:
                    block[..., local : local + real, :, :].copy_(_tokens(h, first, real, stride))
                if real < count:  # padding tokens: zeros
                    block[..., local + real : local + count, :, :].zero_()
    recv = _all_to_all(send, c)
    outs = []
    for h, part in zip(hs, _parts(recv, shapes), strict=True):
        shape = _token_shape(h.shape[:-3], local_length, n * h.shape[-2], h.shape[-1], sd, hd)
        out = part.new_empty(shape)
        blocks = out.movedim((sd, hd), (-3, -2)).unflatten(-2, (n, -1)).movedim(-3, 0)
        if c.order is None:
            blocks.copy_(part)
        else:
            for i in range(n):
                blocks[i].copy_(part[_slot(c, i)])
        outs.append(out)
    return tuple(outs)


def _batched(xs: tuple, dims: tuple, size: int) -> list[torch.Tensor]:
    """Every tensor with its vmap dim at the front (expanded where it has none)."""
    return [
        x.expand(size, *x.shape) if d is None else x if d == 0 else x.movedim(d, 0)
        for x, d in zip(xs, dims, strict=True)
    ]


def _tangents(ctx: Any, ts: tuple, shapes: list[Shape]) -> list[torch.Tensor]:
    return [
        torch.zeros(s, dtype=ctx.dtype, device=ctx.device) if t is None else t
        for t, s in zip(ts, shapes, strict=True)
    ]


@eager_rules
class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(layout: SeqLayout, c: Comm, sd: int, hd: int, *ts: torch.Tensor) -> Any:
        return _to_heads(layout, c, sd, hd, ts)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[:4]
        ctx.shapes = [t.shape for t in inputs[4:]]
        ctx.dtype, ctx.device = inputs[4].dtype, inputs[4].device

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        return (None,) * 4 + tuple(call(_ToTokens, *ctx.args, *gs))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> Any:
        return call(_ToHeads, *ctx.args, *_tangents(ctx, ts[4:], ctx.shapes))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, layout: SeqLayout, c: Comm, sd: int, hd: int, *ts) -> Any:
        xs = _batched(ts, in_dims[4:], info.batch_size)
        return call(_ToHeads, layout, c, sd + 1, hd + 1, *xs), (0,) * len(ts)


@eager_rules
class _ToTokens(torch.autograd.Function):
    @staticmethod
    def forward(layout: SeqLayout, c: Comm, sd: int, hd: int, *hs: torch.Tensor) -> Any:
        return _to_tokens(layout, c, sd, hd, hs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[:4]
        ctx.shapes = [h.shape for h in inputs[4:]]
        ctx.dtype, ctx.device = inputs[4].dtype, inputs[4].device

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        return (None,) * 4 + tuple(call(_ToHeads, *ctx.args, *gs))

    @staticmethod
    def jvp(ctx: Any, *ts: Any) -> Any:
        return call(_ToTokens, *ctx.args, *_tangents(ctx, ts[4:], ctx.shapes))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, layout: SeqLayout, c: Comm, sd: int, hd: int, *hs) -> Any:
        xs = _batched(hs, in_dims[4:], info.batch_size)
        return call(_ToTokens, layout, c, sd + 1, hd + 1, *xs), (0,) * len(hs)


def _apply(fn: type[torch.autograd.Function], *args: Any) -> tuple[torch.Tensor, ...]:
    if torch.compiler.is_compiling():  # runs outside the graph, rules and all
        return apply.eager(fn, *args)
    return call(fn, *args)


def tokens_to_heads(
    layout: SeqLayout, c: Comm, sd: int, hd: int, *ts: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Every token of this rank's ``heads / N`` heads of each of ``ts`` (this rank's tokens
    under ``layout``, ``seq_dim=sd``, ``head_dim=hd``, one dtype and device, heads divisible by
    ``N``), as ``(batch..., heads / N, layout.length, size)`` tensors in sequence order."""
    return _apply(_ToHeads, layout, c, sd, hd, *ts)


def heads_to_tokens(
    layout: SeqLayout, c: Comm, sd: int, hd: int, *hs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`tokens_to_heads`: ``(batch..., heads / N, layout.length, size)``
    tensors -> this rank's tokens with every head, ``seq_dim=sd``, ``head_dim=hd``."""
    return _apply(_ToTokens, layout, c, sd, hd, *hs)

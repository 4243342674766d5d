"""Sequence layouts: how one sequence is padded and dealt out to the ranks of an axis.

Pure index arithmetic (no process group), kept in one place so that every sharded input is
permuted the same way and every output is un-permuted by the exact inverse.

A sequence of ``length`` tokens on ``size`` ranks is first padded at its end to
``padded_length``, a multiple of ``size`` (of ``2 * size`` for ``"zigzag"``); the padding tokens
get the positions ``length, length + 1, ...``. Then each rank takes ``local_length =
padded_length // size`` positions:

- ``"contiguous"``: rank ``r`` holds positions ``[r * L, (r + 1) * L)``;
- ``"zigzag"``: the padded sequence is cut into ``2 * size`` chunks; rank ``r`` holds chunks ``r``
  and ``2 * size - 1 - r`` (so every rank does the same causal-attention work);
- ``"stripe"``: token ``t`` goes to rank ``t % size`` (local index ``t // size``).

A rank holds its positions in ascending order. Concatenating every rank's tokens in rank order
gives the *permuted* sequence: slot ``i`` of it holds position :meth:`SeqLayout.permutation`
``[i]``, and position ``p`` sits in slot :meth:`SeqLayout.inverse` ``[p]``. That is the order
in which an all-to-all over the axis (Ulysses) sees the whole sequence.

Internal interface (used by the sequence transforms):

- ``LAYOUTS``: the layout names; ``check_layout(layout, fn)`` validates one.
- ``SeqLayout(kind, length, size)``: a frozen dataclass with ``padded_length``,
  ``local_length``, ``num_pad``, ``positions(rank)``, ``is_pad(rank)``, ``permutation()``,
  ``inverse()`` and their tensor forms ``position_tensor(rank, device)`` (``rank=None``: the
  whole permuted order).
- ``SeqLayout.runs(rank)``: a rank's positions as strided runs, for copies without index
  tensors; ``SeqLayout.real(first, count, stride)``: how many of a run are real tokens.
- ``pad_permute(x, dim, layout, value)``: the padded, permuted whole tensor (differentiable);
  slicing it in ``size`` equal blocks along ``dim`` gives each rank its tokens.
- ``unpermute_unpad(y, dim, layout)``: the inverse (differentiable).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .._core.caches import cached
from .._core.checks import check_int

__all__ = [
    "LAYOUTS",
    "SeqLayout",
    "along",
    "check_layout",
    "pad_permute",
    "place_blocks",
    "take_blocks",
    "unpermute_unpad",
]

LAYOUTS = ("contiguous", "zigzag", "stripe")


def check_layout(layout: Any, fn: str) -> str:
    """``layout`` if it names a layout, else a ``ValueError`` naming ``fn``."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"{fn}: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}"
        )
    return layout


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """The layout of one sequence of ``length`` tokens over ``size`` ranks.

    Attributes:
        kind: ``"contiguous"``, ``"zigzag"`` or ``"stripe"``.
        length: the true number of tokens (before padding).
        size: the number of ranks.

    Example:
        >>> from pshard.sequence._layouts import SeqLayout
        >>> lay = SeqLayout("zigzag", 7, 2)
        >>> lay.padded_length, lay.local_length, lay.num_pad
        (8, 4, 1)
        >>> lay.positions(0), lay.positions(1)
        ((0, 1, 6, 7), (2, 3, 4, 5))
        >>> lay.is_pad(0)
        (False, False, False, True)
        >>> lay.permutation()
        (0, 1, 6, 7, 2, 3, 4, 5)
        >>> SeqLayout("stripe", 5, 2).positions(1)
        (1, 3, 5)
    """

    kind: str
    length: int
    size: int

    def __post_init__(self) -> None:
        check_layout(self.kind, "SeqLayout")
        check_int("SeqLayout", "length", self.length, minimum=0)
        check_int("SeqLayout", "size", self.size, minimum=1)

    @property
    def multiple(self) -> int:
        """What the padded length is a multiple of: ``size`` (``2 * size`` for zigzag)."""
        return 2 * self.size if self.kind == "zigzag" else self.size

    @property
    def padded_length(self) -> int:
        m = self.multiple
        return -(-self.length // m) * m

    @property
    def local_length(self) -> int:
        """Tokens per rank (padding included)."""
        return self.padded_length // self.size

    @property
    def num_pad(self) -> int:
        """Padding tokens added at the end of the sequence."""
        return self.padded_length - self.length

    def _rank(self, rank: Any) -> int:
        r = check_int("SeqLayout", "rank", rank, minimum=0)
        if r >= self.size:
            raise ValueError(f"SeqLayout: rank {r} is out of range for {self.size} ranks")
        return r

    def positions(self, rank: int) -> tuple[int, ...]:
        """The positions (in the padded sequence) that ``rank`` holds, in its local order;
        positions ``>= length`` are padding."""
        return _positions(self.kind, self.padded_length, self.size, self._rank(rank))

    def runs(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """``rank``'s positions as runs ``(local start, first position, count, stride)``:
        local tokens ``local start + j`` hold positions ``first position + j * stride`` for
        ``j < count``. One run for contiguous and stripe, two for zigzag.

        Example:
            >>> from pshard.sequence._layouts import SeqLayout
            >>> SeqLayout("zigzag", 8, 2).runs(0), SeqLayout("stripe", 8, 2).runs(1)
            (((0, 0, 2, 1), (2, 6, 2, 1)), ((0, 1, 4, 2),))
        """
        return _runs(self.kind, self.padded_length, self.size, self._rank(rank))

    def real(self, first: int, count: int, stride: int) -> int:
        """How many positions of the run ``first + j * stride`` (``j < count``) are real
        tokens (the rest, at its end, are padding)."""
        return max(0, min(count, -(-(self.length - first) // stride)))

    def is_pad(self, rank: int) -> tuple[bool, ...]:
        """For each of ``rank``'s tokens, whether it is padding."""
        return tuple(p >= self.length for p in self.positions(rank))

    def permutation(self) -> tuple[int, ...]:
        """Slot ``i`` of the permuted sequence (every rank's tokens in rank order) holds
        position ``permutation()[i]``."""
        return _permutation(self.kind, self.padded_length, self.size)

    def inverse(self) -> tuple[int, ...]:
        """Position ``p`` sits in slot ``inverse()[p]`` of the permuted sequence."""
        return _inverse(self.kind, self.padded_length, self.size)

    def position_tensor(
        self, rank: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """:meth:`positions` of ``rank`` (``None``: :meth:`permutation`) as an int64 tensor."""
        if rank is not None:
            rank = self._rank(rank)
        return _index_tensor(
            self.kind, self.padded_length, self.size, rank, torch.device(device or "cpu")
        )


# --------------------------------------------------------------------------- cached index math


@cached("sequence layout positions", 512)
def _positions(kind: str, padded: int, size: int, rank: int) -> tuple[int, ...]:
    local = padded // size
    if kind == "contiguous":
        return tuple(range(rank * local, (rank + 1) * local))
    if kind == "stripe":
        return tuple(range(rank, padded, size))
    chunk = local // 2
    first = range(rank * chunk, (rank + 1) * chunk)
    mirror = 2 * size - 1 - rank
    return (*first, *range(mirror * chunk, (mirror + 1) * chunk))


@cached("sequence layout runs", 512)
def _runs(kind: str, padded: int, size: int, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    local = padded // size
    if kind == "contiguous":
        return ((0, rank * local, local, 1),)
    if kind == "stripe":
        return ((0, rank, local, size),)
    chunk = local // 2
    return ((0, rank * chunk, chunk, 1), (chunk, (2 * size - 1 - rank) * chunk, chunk, 1))


@cached("sequence layout permutations", 512)
def _permutation(kind: str, padded: int, size: int) -> tuple[int, ...]:
    return tuple(p for r in range(size) for p in _positions(kind, padded, size, r))


@cached("sequence layout inverse permutations", 512)
def _inverse(kind: str, padded: int, size: int) -> tuple[int, ...]:
    inv = [0] * padded
    for slot, p in enumerate(_permutation(kind, padded, size)):
        inv[p] = slot
    return tuple(inv)


@cached("sequence layout index tensors", 512)
def _index_tensor(
    kind: str, padded: int, size: int, rank: int | None, device: torch.device
) -> torch.Tensor:
    if rank is None:
        values = _permutation(kind, padded, size)
    elif rank == -1:
        values = _inverse(kind, padded, size)
    else:
        values = _positions(kind, padded, size, rank)
    return torch.tensor(values, dtype=torch.int64, device=device)


# --------------------------------------------------------------------------- tensor forms
#
# Both directions copy run by run (SeqLayout.runs: one strided slice per run, no index tensor),
# and each is the other's transpose, so no backward pass scatters into a zero-filled buffer.


def along(x: torch.Tensor, dim: int, first: int, count: int, stride: int) -> torch.Tensor:
    """Entries ``first + j * stride`` (``j < count``) of ``x`` along ``dim``, a view."""
    return x[(slice(None),) * dim + (slice(first, first + stride * (count - 1) + 1, stride),)]


def take_blocks(
    x: torch.Tensor, dim: int, layout: SeqLayout, value: Any, ranks: Iterable[int]
) -> torch.Tensor:
    """The blocks of ``ranks`` (in that order, concatenated along ``dim``) of the whole ``x``
    (``layout.length`` long along ``dim``): each rank's tokens in its order, padding slots filled
    with ``value``. No autograd."""
    ranks = tuple(ranks)
    shape = list(x.shape)
    shape[dim] = len(ranks) * layout.local_length
    out = x.new_empty(shape)
    for i, r in enumerate(ranks):
        base = i * layout.local_length
        for local, first, count, stride in layout.runs(r):
            real = layout.real(first, count, stride)
            if real:
                out.narrow(dim, base + local, real).copy_(along(x, dim, first, real, stride))
            if real < count:
                out.narrow(dim, base + local + real, count - real).fill_(value)
    return out


def place_blocks(blocks: Sequence[torch.Tensor], dim: int, layout: SeqLayout) -> torch.Tensor:
    """The whole sequence (``layout.length`` along ``dim``) from every rank's block, in rank
    order: each real token at its position, padding dropped. No autograd."""
    shape = list(blocks[0].shape)
    shape[dim] = layout.length
    out = blocks[0].new_empty(shape)
    for r, block in enumerate(blocks):
        for local, first, count, stride in layout.runs(r):
            real = layout.real(first, count, stride)
            if real:
                along(out, dim, first, real, stride).copy_(block.narrow(dim, local, real))
    return out


def _permute(x: torch.Tensor, dim: int, layout: SeqLayout, value: Any) -> torch.Tensor:
    return take_blocks(x, dim, layout, value, range(layout.size))


def _unpermute(y: torch.Tensor, dim: int, layout: SeqLayout) -> torch.Tensor:
    return place_blocks(y.chunk(layout.size, dim), dim, layout)


class _PadPermute(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, layout: SeqLayout, value: Any) -> torch.Tensor:
        return _permute(x, dim, layout, value)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.layout = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _Unpermute.apply(g, ctx.dim, ctx.layout), None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _PadPermute.apply(t, ctx.dim, ctx.layout, 0)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, dim: int, layout: SeqLayout, value: Any):
        x = x.movedim(in_dims[0], 0)
        return _PadPermute.apply(x, dim + 1, layout, value), 0


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(y: torch.Tensor, dim: int, layout: SeqLayout) -> torch.Tensor:
        return _unpermute(y, dim, layout)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.layout = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _PadPermute.apply(g, ctx.dim, ctx.layout, 0), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _Unpermute.apply(t, ctx.dim, ctx.layout)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, y: torch.Tensor, dim: int, layout: SeqLayout):
        return _Unpermute.apply(y.movedim(in_dims[0], 0), dim + 1, layout), 0


def pad_permute(x: torch.Tensor, dim: int, layout: SeqLayout, value: Any = 0) -> torch.Tensor:
    """``x`` (``layout.length`` long along ``dim``) padded with ``value`` to
    ``layout.padded_length`` and put in the permuted order; block ``r`` of ``size`` equal blocks
    along ``dim`` is then rank ``r``'s part. Differentiable (its transpose is
    :func:`unpermute_unpad`); ``x`` itself when there is nothing to do.

    Example:
        >>> import torch
        >>> from pshard.sequence._layouts import SeqLayout, pad_permute
        >>> pad_permute(torch.arange(5), 0, SeqLayout("stripe", 5, 2), -1)
        tensor([ 0,  2,  4,  1,  3, -1])
    """
    dim = dim % x.dim()
    if layout.kind == "contiguous" or layout.size == 1:
        if not layout.num_pad:
            return x
        return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, layout.num_pad], value=value)
    if torch.compiler.is_compiling():  # one traceable index_select
        if layout.num_pad:
            x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, layout.num_pad], value=value)
        index = _index_tensor(layout.kind, layout.padded_length, layout.size, None, x.device)
        return x.index_select(dim, index)
    return _PadPermute.apply(x, dim, layout, value)


def unpermute_unpad(y: torch.Tensor, dim: int, layout: SeqLayout) -> torch.Tensor:
    """The inverse of :func:`pad_permute`: ``y`` in the permuted order along ``dim``
    (``layout.padded_length`` long) back in sequence order, padding removed. Differentiable (its
    transpose is :func:`pad_permute` with zeros).

    Example:
        >>> import torch
        >>> from pshard.sequence._layouts import SeqLayout, unpermute_unpad
        >>> unpermute_unpad(torch.tensor([0, 2, 4, 1, 3, -1]), 0, SeqLayout("stripe", 5, 2))
        tensor([0, 1, 2, 3, 4])
    """
    dim = dim % y.dim()
    if layout.kind == "contiguous" or layout.size == 1:
        return y.narrow(dim, 0, layout.length) if layout.num_pad else y
    if torch.compiler.is_compiling():
        index = _index_tensor(layout.kind, layout.padded_length, layout.size, -1, y.device)
        return y.index_select(dim, index[: layout.length] if layout.num_pad else index)
    return _Unpermute.apply(y, dim, layout)

"""The collectives as ``torch.library`` custom ops: one node of a traced program each.

``torch.compile`` (dynamo) and ``ps.jit`` put these in the programs they make, in place of
communication: ``pshard::<name>(Tensor x, str axis, int size, int rank, ...)``, where ``axis``
is the :func:`pshard._runtime.wire.axis_key` of the axis and ``size``/``rank`` what it resolved
to when traced. Running the op resolves the key again in the current mesh, checks size and
index (:func:`pshard._runtime.wire.comm_at_run`) and calls the same raw collective as eager
code; debug checks run then too. A fake (meta) rule gives each output's shape, so tracers and
compilers never communicate. Outputs are contiguous and never alias the input, as the fake
rules say.

Their autograd rules (the transposes) are registered by :mod:`pshard._collectives.compiled`;
:func:`emit` is what a trace of the wire (:mod:`pshard._runtime.tracing`) puts in the program.

Internal interface: :data:`OPS`, :func:`emit`, :func:`encode`, :func:`decode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from .._compat import mark_side_effect
from . import wire
from .wire import Comm

__all__ = ["OPS", "decode", "emit", "encode"]


def _run(key: str, size: int, rank: int, fn: str) -> Comm:
    return wire.comm_at_run(key, size, rank, fn)


@torch.library.custom_op("pshard::psum", mutates_args=())
def _psum(x: torch.Tensor, axis: str, size: int, rank: int) -> torch.Tensor:
    return wire.all_reduce(x, _run(axis, size, rank, "psum"), "psum")


@torch.library.custom_op("pshard::pextreme", mutates_args=())
def _pextreme(x: torch.Tensor, axis: str, size: int, rank: int, op: str) -> torch.Tensor:
    return wire.all_reduce(x, _run(axis, size, rank, op), op)


@torch.library.custom_op("pshard::all_gather", mutates_args=())
def _all_gather(
    x: torch.Tensor, axis: str, size: int, rank: int, dim: int, tiled: bool
) -> torch.Tensor:
    out = wire.all_gather(x, _run(axis, size, rank, "all_gather"), dim, tiled)
    return out.contiguous()


@torch.library.custom_op("pshard::psum_scatter", mutates_args=())
def _psum_scatter(
    x: torch.Tensor, axis: str, size: int, rank: int, dim: int, tiled: bool
) -> torch.Tensor:
    out = wire.reduce_scatter(x, _run(axis, size, rank, "psum_scatter"), dim, tiled)
    return out.contiguous()


@torch.library.custom_op("pshard::all_to_all", mutates_args=())
def _all_to_all(
    x: torch.Tensor, axis: str, size: int, rank: int, split_dim: int, concat_dim: int
) -> torch.Tensor:
    out = wire.all_to_all(x, _run(axis, size, rank, "all_to_all"), split_dim, concat_dim)
    return out.contiguous()


@torch.library.custom_op("pshard::ppermute", mutates_args=())
def _ppermute(x: torch.Tensor, axis: str, size: int, rank: int, perm: list[int]) -> torch.Tensor:
    pairs = tuple(zip(perm[::2], perm[1::2], strict=True))
    return wire.ppermute(x, _run(axis, size, rank, "ppermute"), pairs)


@torch.library.custom_op("pshard::broadcast", mutates_args=())
def _broadcast(x: torch.Tensor, axis: str, size: int, rank: int, src: int) -> torch.Tensor:
    return wire.broadcast(x, _run(axis, size, rank, "broadcast"), src)


@torch.library.custom_op("pshard::reduce", mutates_args=())
def _reduce(x: torch.Tensor, axis: str, size: int, rank: int, dst: int) -> torch.Tensor:
    return wire.reduce(x, _run(axis, size, rank, "reduce"), dst)


@torch.library.custom_op("pshard::ragged_all_to_all", mutates_args=())
def _ragged(
    x: torch.Tensor, axis: str, size: int, rank: int, send_counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return wire.ragged(x, send_counts, _run(axis, size, rank, "ragged_all_to_all"))


@_ragged.register_fake
def _(
    x: torch.Tensor, axis: str, size: int, rank: int, send_counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.library.get_ctx().new_dynamic_size()  # as many as the data say
    return x.new_empty((rows, *x.shape[1:])), send_counts.new_empty((size,))


#: name -> the op of that collective; read-only.
OPS: Mapping[str, Any] = MappingProxyType(
    {
        "psum": _psum,
        "pextreme": _pextreme,
        "all_gather": _all_gather,
        "psum_scatter": _psum_scatter,
        "all_to_all": _all_to_all,
        "ppermute": _ppermute,
        "broadcast": _broadcast,
        "reduce": _reduce,
        "ragged_all_to_all": _ragged,
    }
)

# Communication is a side effect: a compiler must neither drop a collective whose result a
# rank does not read (the other ranks wait for it) nor move one past another
for _op in OPS.values():
    mark_side_effect(_op._opoverload)


# --- shapes (fake rules) ----------------------------------------------------------------------


def _same_shape(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


@_all_gather.register_fake
def _(x: torch.Tensor, axis: str, size: int, rank: int, dim: int, tiled: bool) -> torch.Tensor:
    shape = list(x.shape)
    if tiled:
        shape[dim] *= size
    else:
        shape.insert(dim, size)
    return x.new_empty(shape)


@_psum_scatter.register_fake
def _(x: torch.Tensor, axis: str, size: int, rank: int, dim: int, tiled: bool) -> torch.Tensor:
    shape = list(x.shape)
    if tiled:
        shape[dim] //= size
    else:
        del shape[dim]
    return x.new_empty(shape)


@_all_to_all.register_fake
def _(
    x: torch.Tensor, axis: str, size: int, rank: int, split_dim: int, concat_dim: int
) -> torch.Tensor:
    shape = list(x.shape)
    shape[split_dim] //= size
    shape[concat_dim] *= size
    return x.new_empty(shape)


for _op in (_psum, _pextreme, _ppermute, _broadcast, _reduce):
    _op.register_fake(_same_shape)


def encode(name: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
    """``params`` as an op's schema takes them (a permutation as a flat list of ints)."""
    if name == "ppermute":
        (perm,) = params
        return ([i for pair in perm for i in pair],)
    return params


def decode(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The inverse of :func:`encode`."""
    if name == "ppermute":
        (flat,) = args
        return (tuple(zip(flat[::2], flat[1::2], strict=True)),)
    return tuple(args)


def emit(name: str, x: torch.Tensor, c: Comm, params: tuple[Any, ...]) -> torch.Tensor:
    """The node of collective ``name`` of ``x`` over ``c`` (resolved with its key)."""
    return OPS[name](x, c.key, c.size, c.rank, *encode(name, params))

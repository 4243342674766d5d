"""The collectives as ``torch.library`` custom ops, for code that ``torch.compile`` traces.

Eager code runs the ``autograd.Function`` s of :mod:`pshard._collectives.rules` (every
``torch.func`` rule there); while dynamo traces, :func:`pshard._collectives.functions` puts one
of these ops in the graph instead, so a collective is one node of the graph, not a graph break:

* ``pshard::<name>(Tensor x, str axis, int size, int rank, ...)``: ``axis`` is the
  :func:`pshard._runtime.wire.axis_key` of the axis and ``size``/``rank`` what it resolved to
  when traced. Running the op resolves the key again in the current mesh, checks size and index
  (:func:`pshard._runtime.wire.comm_at_run`) and calls the same raw collective as eager code;
  debug checks run then too.
* a fake (meta) rule gives the output's shape, so the tracer and inductor never communicate;
* an autograd rule: the transpose (:func:`pshard._collectives.transposes.transpose`, the table
  the eager Functions use too), again one of these ops (``.backward()`` through a compiled
  region, and compiled backward graphs).

Outputs are contiguous and never alias the input, as the fake rules say. ``torch.func``
transforms inside a compiled region do not reach these ops: the graph breaks there, and the
transform runs eagerly with the exact rules (dynamo traces an ``autograd.Function`` 's custom
``jvp`` wrongly, and a custom op has no ``torch.func`` rules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .._runtime import wire
from .._runtime.wire import Comm
from .transposes import LINEAR, decode, encode, transpose

__all__ = ["OPS"]


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
    }
)


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


# --- transposes (autograd rules) --------------------------------------------------------------


def _save_where(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.where, ctx.args = inputs[1:4], inputs[4:]


def _transpose_of(name: str) -> Callable[..., tuple[Any, ...]]:
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        other, params = transpose(name, decode(name, ctx.args))
        out = OPS[other](g, *ctx.where, *encode(other, params))
        return (out, None, None, None, *[None] * len(ctx.args))

    return backward


for _name in LINEAR:
    OPS[_name].register_autograd(_transpose_of(_name), setup_context=_save_where)


def _pextreme_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    # (sum of the cotangents) to the ranks holding the extreme, split evenly between ties
    x, out = ctx.saved_tensors
    holds = (x == out).to(g.dtype)
    both = _psum(torch.stack([g, holds]), *ctx.where)
    return both[0] * holds / both[1], None, None, None, None


def _save_extreme(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.where = inputs[1:4]
    ctx.save_for_backward(inputs[0], output)


_pextreme.register_autograd(_pextreme_backward, setup_context=_save_extreme)

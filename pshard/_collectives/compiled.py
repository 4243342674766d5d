"""The autograd rules of the collectives' custom ops (:mod:`pshard._runtime.ops`), for code that
``torch.compile`` traces.

Eager code runs the ``autograd.Function`` s of :mod:`pshard._collectives.rules` (every
``torch.func`` rule there); while dynamo traces, :func:`pshard._collectives.functions` puts one
of the ops in the graph instead, so a collective is one node of the graph, not a graph break.
Each op's autograd rule here is its transpose (:func:`pshard._collectives.transposes.transpose`,
the table the eager Functions use too), again one of the ops (``.backward()`` through a
compiled region, and compiled backward graphs).

``torch.func`` transforms inside a compiled region do not reach these ops: the graph breaks
there, and the transform runs eagerly with the exact rules (dynamo traces an
``autograd.Function`` 's custom ``jvp`` wrongly, and a custom op has no ``torch.func`` rules).
``ps.jit`` traces those transforms itself, through the Functions' rules, down to the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._runtime.ops import OPS, decode, encode
from .transposes import LINEAR, transpose

__all__ = ["OPS"]

_psum = OPS["psum"]
_pextreme = OPS["pextreme"]


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

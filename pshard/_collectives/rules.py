"""The collectives as ``torch.autograd.Function`` s, for eager code and ``torch.func``.

Each collective is a Function in the new style (``forward`` without ``ctx``, ``setup_context``)
with three rules beside the forward:

* ``backward``: the transpose (:func:`pshard._collectives.transposes.transpose`); ``pmax`` /
  ``pmin`` send the summed cotangent to the ranks holding the extreme value, split evenly
  between ties.
* ``jvp``: the tangent through the same collective (the linear ones); ``pmax`` / ``pmin``
  average the tangents of the ranks holding the extreme value.
* ``vmap``: the batch dim moved to the front and the collective run once on the whole batch,
  its dims shifted by one (:func:`pshard._collectives.transposes.batched`).

Every rule calls a Function again (through :func:`pshard._collectives.apply.call`), never a
raw collective, so higher-order derivatives (``grad(grad)``, ``hessian``, ``vmap(grad)``,
``jacfwd(jacrev)``) work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .._runtime import wire
from .._runtime.wire import Comm
from .apply import call, eager_rules
from .transposes import LINEAR, batched, transpose

__all__ = ["FUNCTIONS", "PExtreme"]


def _front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


_RAW: dict[str, Callable[..., torch.Tensor]] = {
    "psum": lambda x, c: wire.all_reduce(x, c, "psum"),
    "all_gather": wire.all_gather,
    "psum_scatter": wire.reduce_scatter,
    "all_to_all": wire.all_to_all,
    "ppermute": wire.ppermute,
    "broadcast": wire.broadcast,
    "reduce": wire.reduce,
}


def _linear(name: str) -> type[torch.autograd.Function]:
    """The Function of the linear collective ``name``: ``(x, c, *params)``."""
    raw = _RAW[name]

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor, c: Comm, *params: Any) -> torch.Tensor:
            return raw(x, c, *params)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            ctx.c, ctx.params = inputs[1], inputs[2:]

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
            other, params = transpose(name, ctx.params)
            return (call(FUNCTIONS[other], g, ctx.c, *params), None, *[None] * len(params))

        @staticmethod
        def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
            return call(FUNCTIONS[name], t, ctx.c, *ctx.params)

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: Comm, *params: Any
        ) -> Any:
            bdim = in_dims[0]
            if bdim is None:
                return call(FUNCTIONS[name], x, c, *params), None
            return call(FUNCTIONS[name], _front(x, bdim), c, *batched(name, params)), 0

    Linear.__name__ = Linear.__qualname__ = "".join(w.title() for w in name.split("_"))
    return eager_rules(Linear)


@eager_rules
class PExtreme(torch.autograd.Function):
    """pmax (``op="pmax"``) or pmin (``op="pmin"``): ``(x, c, op)``."""

    @staticmethod
    def forward(x: torch.Tensor, c: Comm, op: str) -> torch.Tensor:
        return wire.all_reduce(x, c, op)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.c = inputs[1]
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d/dx_r sum_s <g_s, out> = (sum_s g_s) * holds_r / (number of holders)
        x, out = ctx.saved_tensors
        holds = (x == out).to(g.dtype)
        both = call(FUNCTIONS["psum"], torch.stack([g, holds]), ctx.c)
        return both[0] * holds / both[1], None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        # the mean of the holders' tangents
        x, out = ctx.saved_tensors
        holds = (x == out).to(t.dtype)
        both = call(FUNCTIONS["psum"], torch.stack([t * holds, holds]), ctx.c)
        return both[0] / both[1]

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, c: Comm, op: str) -> Any:
        bdim = in_dims[0]
        return call(PExtreme, _front(x, bdim), c, op), None if bdim is None else 0


#: name -> the Function of that collective (``"pextreme"``: pmax / pmin); read-only.
FUNCTIONS: Mapping[str, type[torch.autograd.Function]] = MappingProxyType(
    {**{name: _linear(name) for name in LINEAR}, "pextreme": PExtreme}
)

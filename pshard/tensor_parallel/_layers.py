"""What a split layer computes on this rank's blocks (one function per style, see
:mod:`pshard.tensor_parallel._plan`).

Every function reads the layer's parameters from the module as ``functional_call`` left them
(this rank's blocks), checks their shapes against the plan, and communicates with pshard's
differentiable collectives, so the whole model's result comes out of every rank and gradients
follow their transposes (the rules of ``shard_map``: inside a map, a whole value's cotangent is
held as per-rank shares that the map's boundary sums).

Internal interface: ``Split`` (the axis, its size, this rank, whether the loss is computed on
the split vocabulary) and ``run_layer(layer, module, forward, args, kwargs, split)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._collectives.functions import all_gather, psum, psum_scatter
from .._core.caches import cached
from .._core.tree import describe
from ._plan import Layer, block_shape

__all__ = ["Split", "run_layer"]

_FN = "tensor_parallel"


@dataclasses.dataclass(frozen=True)
class Split:
    """The axis as a call sees it: its name, size, this rank, and whether the head's output
    stays split over the vocabulary."""

    axis: str
    size: int
    rank: int
    loss_parallel: bool

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s tokens (dim 1) from every rank."""
        return all_gather(x, self.axis, dim=1, tiled=True)


def run_layer(
    layer: Layer,
    module: torch.nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: Split,
) -> Any:
    """What ``module`` (split by ``layer``) returns for this call; ``forward`` is its own."""
    if layer.style == "sequence":
        return _sequence(layer, forward, args, kwargs, split)
    if layer.style == "gather":
        return _gathered(layer, forward, args, kwargs, split)
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise TypeError(
            f"{_FN}: module {layer.name!r} ({layer.describe()}) was called with "
            f"{len(args)} positional argument(s) and keywords {sorted(kwargs)}; a split layer "
            f"takes its input tensor as its one argument"
        )
    x = args[0]
    params = {n: getattr(module, n) for n in layer.whole}
    _check_blocks(layer, params, split)
    if layer.style == "vocab":
        return _vocab(layer, x, params["weight"], module, split)
    weight, bias = params["weight"], params.get("bias")
    if layer.layout == "transposed":
        weight = weight.t()
    if layer.style == "colwise":
        if layer.gather_input:
            x = split.gather_tokens(x)
        y = F.linear(x, weight, bias)
        if layer.select is not None:
            ranks, width = layer.select
            y = y.narrow(-1, split.rank // ranks * width, width)
        if layer.head and not split.loss_parallel:
            y = _gather_features(y, _out_features(layer), split)
        return y
    y = F.linear(x, weight)
    y = psum_scatter(y, split.axis, dim=1) if layer.scatter_output else psum(y, split.axis)
    return y if bias is None else y + bias


def _out_features(layer: Layer) -> int:
    shape = layer.whole["weight"]
    return shape[0] if layer.layout == "linear" else shape[1]


def _check_blocks(layer: Layer, params: dict[str, Any], split: Split) -> None:
    for name, value in params.items():
        spec = layer.specs[name]
        want = _block_shape(spec, layer.whole[name], split.size, split.rank)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else describe(value)
            raise ValueError(
                f"{_FN}: {layer.name}.{name} is {got}, but the plan ({layer.describe()}) "
                f"splits it as {spec!r}, so that rank {split.rank} of axis {split.axis!r} (size "
                f"{split.size}) holds a block of shape {want} (the whole is "
                f"{layer.whole[name]}); call the model inside a map over {split.axis!r} on the "
                f"blocks of ps.tensor_parallel_specs(model) (the map's in_specs)"
            )


@cached("pshard.tensor_parallel.block_shape", maxsize=4096)
def _block_shape(spec: Any, whole: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """:func:`block_shape`, remembered (a pure function of small arguments)."""
    return block_shape(spec, whole, size, rank)


def _gather_features(y: torch.Tensor, whole: int, split: Split) -> torch.Tensor:
    """The whole last dim from every rank's ``torch.chunk`` block (padded to the largest)."""
    piece = -(-whole // split.size)
    if y.shape[-1] < piece:
        pad = list(y.shape)
        pad[-1] = piece - y.shape[-1]
        y = torch.cat([y, y.new_zeros(pad)], -1)
    return all_gather(y, split.axis, dim=-1, tiled=True).narrow(-1, 0, whole)


def _vocab(
    layer: Layer, ids: torch.Tensor, weight: torch.Tensor, module: Any, split: Split
) -> torch.Tensor:
    """An embedding split by rows: each rank looks up the ids it holds; the sum over the
    axis is the whole lookup."""
    rows = weight.shape[0]
    start = min(split.rank * -(-layer.whole["weight"][0] // split.size), layer.whole["weight"][0])
    local = ids - start
    held = (local >= 0) & (local < rows)
    if rows:
        padding = module.padding_idx
        padding = padding - start if padding is not None and 0 <= padding - start < rows else None
        out = F.embedding(local.clamp(0, rows - 1), weight, padding)
        out = out.masked_fill(~held.unsqueeze(-1), 0)
    else:
        out = weight.new_zeros((*ids.shape, weight.shape[1]))
    return psum(out, split.axis)


def _gathered(
    layer: Layer,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: Split,
) -> Any:
    """A module holding a parallel pair inside a sequence region: its first argument (by
    position or by the name of ``forward``'s first parameter) with the tokens of every rank."""
    if args and isinstance(args[0], torch.Tensor):
        return forward(split.gather_tokens(args[0]), *args[1:], **kwargs)
    first = next(iter(inspect.signature(forward).parameters), None)
    if first is not None and isinstance(kwargs.get(first), torch.Tensor):
        return forward(*args, **{**kwargs, first: split.gather_tokens(kwargs[first])})
    raise TypeError(
        f"{_FN}: module {layer.name!r} ({layer.describe()}) gathers the tokens of its first "
        f"argument, which must be a tensor (by position or as {first!r}); got positional "
        f"{[describe(a) for a in args]} and keywords {sorted(kwargs)}"
    )


def _sequence(
    layer: Layer,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: Split,
) -> Any:
    """A module run on this rank's share of the tokens (Megatron sequence parallelism)."""
    if layer.split_tokens:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise TypeError(
                f"{_FN}: module {layer.name!r} ({layer.describe()}) splits the tokens (dim 1) "
                f"of its first argument, which must be a tensor of at least 2 dims passed by "
                f"position; got {describe(args[0]) if args else 'none'}"
            )
        x = args[0]
        length = x.shape[1]
        if length % split.size:
            raise ValueError(
                f"{_FN}: module {layer.name!r} ({layer.describe()}) splits its input's "
                f"{length} tokens (dim 1) over axis {split.axis!r} of size {split.size}, which "
                f"must divide them (Megatron sequence parallelism); pad the sequences to a "
                f"multiple of {split.size}"
            )
        piece = length // split.size
        args = (x.narrow(1, split.rank * piece, piece), *args[1:])
    out = forward(*args, **kwargs)
    if not layer.gather_tokens:
        return out
    if isinstance(out, torch.Tensor):
        return all_gather(out, split.axis, dim=1, tiled=True)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (all_gather(out[0], split.axis, dim=1, tiled=True), *out[1:])
    raise TypeError(
        f"{_FN}: module {layer.name!r} ({layer.describe()}) ends the sequence-parallel region "
        f"and gathers its output's tokens, which must be a tensor (or a tuple starting with "
        f"one), got {describe(out)}"
    )
